"""The cheaper forms of interpreter_active, backend_for, check_tensor's shape test and the memo stamp
keep the exact answers and messages of the straightforward ones."""

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flowlock
from flowlock.dispatch import backend_for, interpreter_active
from flowlock.ops._validate import check_index, check_tensor


def test_interpreter_active_follows_every_change_of_the_environment(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not interpreter_active()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert interpreter_active()
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not interpreter_active()
    os.environ["TRITON_INTERPRET"] = "1"
    assert interpreter_active()
    os.environ["TRITON_INTERPRET"] = "true"
    assert not interpreter_active()


def test_backend_for_forced_default_and_errors_are_unchanged(monkeypatch):
    x, meta = torch.zeros(2), torch.zeros(2, device="meta")
    assert backend_for("op", None, x) == "reference"
    with flowlock.use_backend("triton"):
        assert backend_for("op", x, None, x) == "triton"
        with flowlock.use_backend("reference"):
            assert backend_for("op", x) == "reference"
        assert backend_for("op", x) == "triton"
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(RuntimeError, match=r"^op: the triton backend on cpu needs TRITON_INTERPRET=1$"):
            backend_for("op", x)
    with pytest.raises(ValueError, match=r"^op: all tensors must be on one device, got \['cpu', 'meta'\]$"):
        backend_for("op", x, None, meta)
    with pytest.raises(ValueError, match=r"^op: all tensors must be on one device, got \[\]$"):
        backend_for("op", None)


def _spec_accepts(size, shape):
    return len(size) == len(shape) and all(e is None or e == s for e, s in zip(shape, size))


@settings(max_examples=200, deadline=None)
@given(size=st.lists(st.integers(0, 3), max_size=3),
       shape=st.lists(st.one_of(st.none(), st.integers(0, 3)), max_size=3))
def test_check_tensor_shape_decision_matches_the_entrywise_rule(size, shape):
    t = torch.zeros(size)
    if _spec_accepts(size, shape):
        assert check_tensor("x", t, shape=tuple(shape)) is t
    else:
        want = ", ".join(r"\*" if e is None else str(e) for e in shape)
        with pytest.raises(ValueError, match=rf"^x must have shape \({want}\), got "):
            check_tensor("x", t, shape=tuple(shape))


def test_index_memo_sees_a_new_shape_or_stride_of_the_same_tensor():
    idx = torch.tensor([0, 1, 2, 3])
    with pytest.raises(ValueError, match="got min 0 max 3"):
        check_index("idx", idx, length=None, upper=3, device=idx.device)
    # Same object and storage; every other element now: max 2.
    idx.as_strided_((2,), (2,))
    assert check_index("idx", idx, length=2, upper=3, device=idx.device) is idx
