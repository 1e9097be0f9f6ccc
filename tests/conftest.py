"""Test session set-up: Triton runs under its CPU interpreter, every ``torch.empty*`` allocation
is poisoned so a kernel that leaves an output element unwritten fails loudly, and every test starts
from a seed of its own name so its random data is the same whichever worker or order runs it."""

import os
import zlib

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from flowlock.testing import poison_  # noqa: E402

_EMPTY_FNS = ("empty", "empty_like", "empty_strided")


@pytest.fixture(autouse=True)
def poisoned_allocations(monkeypatch):
    for name in _EMPTY_FNS:
        original = getattr(torch, name)

        def poisoned(*args, __original=original, **kwargs):
            return poison_(__original(*args, **kwargs))

        monkeypatch.setattr(torch, name, poisoned)
    yield


@pytest.fixture(autouse=True)
def seeded_by_test_name(request):
    # Unseeded data made a failure depend on which tests an xdist worker ran before; a seed from
    # the test's own id makes every run of one test see the same data, and each test its own.
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    yield


@pytest.fixture(autouse=True)
def no_tf32():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
