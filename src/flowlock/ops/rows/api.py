"""Public row gather / scatter of a packed (B, S, H) sequence.

These replace diffusers' ``index_select`` (whose backward is an atomic, non-repeatable scatter-add
on GPU) and ``new_zeros`` + ``index_copy``. Indices must be unique (and, for a scatter, disjoint
across parts): that is what makes both directions pure copies. It is checked here, before any
launch, and never repaired.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flowlock.dispatch import backend_for
from flowlock.ops._graph import needs_graph
from flowlock.ops._triton_utils import traced
from flowlock.ops._validate import FLOAT_DTYPES, check_index, check_tensor
from flowlock.ops.rows.opaque import gather_rows_reference_op, scatter_rows_reference_op
from flowlock.ops.rows.reference import gather_rows_reference, scatter_rows_reference
from flowlock.ops.rows.triton import (
    GatherRowsFunction,
    ScatterRowsFunction,
    _gather_rows_op,
    _scatter_rows_op,
    gather_rows_fwd,
    scatter_rows_fwd,
)


def _check_rows_tensor(name: str, t: object) -> torch.Tensor:
    check_tensor(name, t, dtypes=FLOAT_DTYPES, ndim=3)
    if t.shape[2] > 1 and t.stride(2) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")
    return t


def _check_unique(name: str, index: torch.Tensor) -> None:
    if index.numel() and torch.unique(index).numel() != index.numel():
        raise ValueError(f"{name} must hold unique row indices (a repeated row would make the backward "
                         "an accumulation)")


def gather_rows(x: torch.Tensor, index: torch.Tensor, *, check_indices: bool = True) -> torch.Tensor:
    """``out[b, n] = x[b, index[n]]``.

    Args:
        x: (B, S, H) float32 / bfloat16 / float16, last dim contiguous.
        index: (N,) int32 / int64 on ``x``'s device, unique values in ``[0, S)``.
        check_indices: ``False`` skips the range and uniqueness checks (two host readbacks) for
            model code that validated its indices once per forward.

    Returns:
        (B, N, H) in ``x.dtype``. Forward and backward are exact copies: the gradient of ``x`` is
        the output gradient scattered into zeros, bitwise repeatable and batch-invariant.
    """
    _check_rows_tensor("x", x)
    check_index("index", index, length=None, upper=x.shape[1], device=x.device, check_range=check_indices)
    if check_indices:
        _check_unique("index", index)
    if backend_for("gather_rows", x, index) == "reference":
        return (gather_rows_reference_op if traced() else gather_rows_reference)(x, index)
    if needs_graph(x):
        return GatherRowsFunction.apply(x, index)
    return (_gather_rows_op if traced() else gather_rows_fwd)(x, index)


def scatter_rows(parts: Sequence[torch.Tensor], indices: Sequence[torch.Tensor], seq_len: int, *,
                 check_indices: bool = True) -> torch.Tensor:
    """``out[b, indices[p][n]] = parts[p][b, n]``; rows no part covers are zero.

    Args:
        parts: non-empty list of (B, Ni, H) tensors sharing B, H, dtype (float32 / bfloat16 /
            float16) and device, last dim contiguous.
        indices: one (Ni,) int32 / int64 tensor per part, values in ``[0, seq_len)``, unique and
            disjoint across parts.
        seq_len: S, the number of rows of the output.
        check_indices: ``False`` skips the range and uniqueness checks (host readbacks).

    Returns:
        (B, S, H) in the parts' dtype, bitwise equal to ``new_zeros`` + ``index_copy`` per part.
        The gradient of each part is a gather of the output gradient (an exact copy).
    """
    if not isinstance(parts, (list, tuple)) or not parts:
        raise TypeError("parts must be a non-empty list of tensors")
    if not isinstance(indices, (list, tuple)) or len(indices) != len(parts):
        raise TypeError(f"indices must be a list with one tensor per part ({len(parts)})")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0:
        raise ValueError(f"seq_len must be a non-negative int, got {seq_len!r}")
    first = _check_rows_tensor("parts[0]", parts[0])
    for p, part in enumerate(parts):
        _check_rows_tensor(f"parts[{p}]", part)
        if part.dtype != first.dtype:
            raise TypeError(f"parts[{p}] has dtype {part.dtype}, parts[0] has {first.dtype}")
        if part.device != first.device:
            raise ValueError(f"parts[{p}] is on {part.device}, parts[0] on {first.device}")
        if part.shape[0] != first.shape[0] or part.shape[2] != first.shape[2]:
            raise ValueError(f"parts[{p}] has shape {tuple(part.shape)}, incompatible with parts[0] "
                             f"{tuple(first.shape)} (batch and hidden must match)")
        check_index(f"indices[{p}]", indices[p], length=part.shape[1], upper=seq_len, device=first.device,
                    check_range=check_indices)
    if check_indices:
        _check_unique("indices (all parts together)", torch.cat([i.long() for i in indices]))
    if backend_for("scatter_rows", *parts, *indices) == "reference":
        return (scatter_rows_reference_op if traced() else scatter_rows_reference)(list(parts), list(indices), seq_len)
    if needs_graph(*parts):
        return ScatterRowsFunction.apply(seq_len, len(parts), *parts, *indices)
    # The same launcher (or, while tracing, the same custom op) ScatterRowsFunction.forward calls.
    return (_scatter_rows_op if traced() else scatter_rows_fwd)(list(parts), list(indices), seq_len)
