import gc

import pytest
import torch

from flowlock.ops import _validate
from flowlock.ops._validate import check_finite_range, check_index, check_tensor


def test_index_range_is_read_once_per_tensor_version(monkeypatch):
    calls = []
    real = torch.aminmax
    monkeypatch.setattr(torch, "aminmax", lambda t: calls.append(1) or real(t))
    idx = torch.tensor([0, 2, 1])
    for upper in (3, 3, 4):
        check_index("idx", idx, length=3, upper=upper, device=idx.device)
    assert len(calls) == 1
    idx[1] = 7  # an in-place write bumps the version counter: the memo must not hide it
    with pytest.raises(ValueError, match=r"idx values must lie in \[0, 3\), got min 0 max 7"):
        check_index("idx", idx, length=3, upper=3, device=idx.device)
    assert len(calls) == 2
    with pytest.raises(ValueError, match="min -1"):
        check_index("view", torch.tensor([-1, 0])[:1], length=None, upper=3, device=idx.device)


def test_range_memo_sees_in_place_updates_and_releases_tensors():
    t = torch.tensor([0.25, 0.5])
    check_finite_range("t", t, 0.0, 1.0)
    t.mul_(1000.0)
    with pytest.raises(ValueError, match="t values must lie in"):
        check_finite_range("t", t, 0.0, 1.0)
    # Other tests' tensors may be collected by the same gc pass, so watch this tensor's own entry.
    held = [key for key, (ref, _) in _validate._MEMO.items() if ref() is t]
    assert len(held) == 1
    del t
    gc.collect()
    assert held[0] not in _validate._MEMO


def test_check_tensor_names_the_argument():
    with pytest.raises(TypeError, match="weight must have dtype"):
        check_tensor("weight", torch.zeros(2, dtype=torch.int32), dtypes=(torch.float32,))
    with pytest.raises(ValueError, match=r"x must have shape \(\*, 4\)"):
        check_tensor("x", torch.zeros(2, 3), shape=(None, 4))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        check_tensor("x", [1.0])


def test_memoized_over_reuses_a_group_and_recomputes_when_any_member_changes():
    from flowlock.ops._validate import memoized_over

    a, b, c = torch.arange(3), torch.arange(3, 5), torch.arange(5, 9)
    calls = []

    def compute():
        calls.append(1)
        return len(calls)

    assert memoized_over([a, b, c], "w", compute) == 1
    assert memoized_over([a, b, c], "w", compute) == 1
    c[0] = 7  # in place: the version counter moves
    assert memoized_over([a, b, c], "w", compute) == 2
    other = c.clone()  # an equal but different object
    assert memoized_over([a, b, other], "w", compute) == 3
    assert memoized_over([a, b, other], "w2", compute) == 4
    a[0] = 1
    assert memoized_over([a, b, other], "w", compute) == 5


def test_memoized_over_caches_nothing_when_compute_raises():
    from flowlock.ops._validate import memoized_over

    a, b = torch.arange(3), torch.arange(3)

    def bad():
        raise ValueError("no")

    for _ in range(2):
        with pytest.raises(ValueError, match="no"):
            memoized_over([a, b], "x", bad)
    assert memoized_over([a, b], "x", lambda: "ok") == "ok"
