"""Input validation shared by every op's public API.

Every check runs before any kernel launch and raises ``TypeError`` (wrong type or dtype) or
``ValueError`` (shape, device, range) naming the offending argument, so a bad call never leaves an
output half-written. Range checks read values back to the host, which stalls the launch queue; the
values they read (an index tensor's min and max, whether a tensor is finite and in a range) are
memoized per tensor object, keyed by its storage pointer and autograd version counter, so a tensor
reused across calls (a layout's indices, a schedule) is read once. Writes that bypass the version
counter (``.data``, raw kernels) are not seen: such callers must pass fresh tensors. Model code that
validated its indices once per forward passes ``check_indices=False`` to the ops it calls.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_tensor(
    name: str,
    t: object,
    *,
    dtypes: Sequence[torch.dtype] | None = None,
    ndim: int | None = None,
    shape: Sequence[int | None] | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Check type, dtype, rank, shape (``None`` entries are free) and device of one argument."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({allowed}), got {str(t.dtype).replace('torch.', '')}")
    if ndim is not None and t.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    # A fully given shape matches as one tuple comparison; the per-entry walk runs only for free entries.
    if shape is not None and t.shape != shape:
        bad = t.ndim != len(shape)
        for e, s in zip(shape, t.shape):
            bad = bad or (e is not None and e != s)
        if bad:
            want = ", ".join("*" if e is None else str(e) for e in shape)
            raise ValueError(f"{name} must have shape ({want}), got {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    return t


def check_index(name: str, idx: object, *, length: int | None, upper: int, device: torch.device,
                check_range: bool = True) -> torch.Tensor:
    """Check a 1-D integer index tensor on ``device`` whose values lie in ``[0, upper)``.

    Values are never clamped: an out-of-range entry is a ``ValueError``.
    """
    check_tensor(name, idx, dtypes=INDEX_DTYPES, ndim=1, device=device)
    n = idx.shape[0]
    if length is not None and n != length:
        raise ValueError(f"{name} must have {length} entries, got {n}")
    if check_range and n > 0:
        lo, hi = _memoized(idx, "aminmax", lambda: tuple(int(v) for v in torch.aminmax(idx)))
        if lo < 0 or hi >= upper:
            raise ValueError(f"{name} values must lie in [0, {upper}), got min {lo} max {hi}")
    return idx


def check_finite_range(name: str, t: torch.Tensor, lo: float, hi: float) -> None:
    """Every value of ``t`` must be finite and in ``[lo, hi]`` (a host readback)."""
    if t.numel() == 0:
        return
    first = _memoized(t, ("range", lo, hi), lambda: _first_outside(t, lo, hi))
    if first is not None:
        raise ValueError(f"{name} values must lie in [{lo}, {hi}], found {first}")


def _first_outside(t: torch.Tensor, lo: float, hi: float) -> float | None:
    bad = ~torch.isfinite(t) | (t < lo) | (t > hi)
    return t[bad].flatten()[0].item() if bool(bad.any()) else None


# id(tensor) -> (weak reference, {what: (stamp, value)}); tensors compare elementwise, so they cannot
# be dictionary keys themselves. The weak reference's callback drops the entry with the tensor.
_MEMO: dict[int, tuple[weakref.ref, dict]] = {}


def _stamp(t: torch.Tensor) -> tuple:
    # torch.Size is a tuple and stride() returns one: both compare by value as they are.
    return t.data_ptr(), t._version, t.shape, t.stride()


def _memoized(t: torch.Tensor, what: object, compute: Callable[[], object]) -> object:
    """``compute()`` for ``t``, reused while ``t`` keeps its storage pointer and version counter."""
    stamp = _stamp(t)
    key = id(t)
    slot = _MEMO.get(key)
    if slot is None or slot[0]() is not t:
        slot = (weakref.ref(t, lambda _, key=key: _MEMO.pop(key, None)), {})
        _MEMO[key] = slot
    entries = slot[1]
    hit = entries.get(what)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    value = compute()
    entries[what] = (stamp, value)
    return value


def memoized_over(tensors: Sequence[torch.Tensor], what: object, compute: Callable[[], object]) -> object:
    """``compute()`` for a group of tensors (a layout's row indices), reused while every tensor of the
    group is the same object with the same storage pointer and version counter.

    The value lives in one slot per ``what`` on the first tensor (see :func:`_memoized`); the other
    tensors are held by weak reference and compared by identity as well as by stamp, so a new tensor
    that happens to reuse a freed one's storage is never mistaken for it. A different group
    overwrites the slot, so it never grows. ``compute`` raising caches nothing.
    """
    first, rest = tensors[0], tuple(tensors[1:])
    slot = _memoized(first, ("group", what), lambda: [None, None, None])
    stamps = tuple(_stamp(t) for t in rest)
    refs, seen, value = slot
    if refs is None or len(refs) != len(rest) or any(r() is not t for r, t in zip(refs, rest)) or seen != stamps:
        value = compute()
        slot[:] = [tuple(weakref.ref(t) for t in rest), stamps, value]
    return value
