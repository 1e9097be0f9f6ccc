"""Session-wide models of the checkpoint tests (building them is the slow part)."""

import pytest
from h3_checkpoints import FULL_NAMES_CONFIG

from flowlock.models.minimax_h3.tiny import make_h3, tiny_h3


@pytest.fixture(scope="session")
def tiny_model():
    return tiny_h3()


@pytest.fixture(scope="session")
def full_names_model():
    return make_h3(FULL_NAMES_CONFIG, seed=3)


@pytest.fixture
def unpoisoned(monkeypatch):
    """The real ``torch.empty`` for a ``torch.device("meta")`` build of a full-size model (meta tensors
    have no memory to poison). The device context recognises constructors through a cached set of
    torch functions; filled while ``torch.empty`` was the poisoning wrapper (any earlier ``with
    torch.device(...)``), it would not see the real one and allocate on the CPU, so it is refilled."""
    from torch.utils._device import _device_constructors

    monkeypatch.undo()
    _device_constructors.cache_clear()
    yield
    _device_constructors.cache_clear()
