"""PyTorch spec of segment_sum: an fp64 one-hot matmul rounded once to fp32."""

from __future__ import annotations

import torch


def _one_hot(index: torch.Tensor, num_segments: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(index.long(), num_segments).to(torch.float64)


def segment_sum_reference(values: torch.Tensor, index: torch.Tensor, num_segments: int) -> torch.Tensor:
    """``(R, N)`` fp32: each segment's sum in fp64, rounded once (differentiable in ``values``).

    More accurate than the Triton path (which rounds every fp32 addition), so not bitwise equal to it.
    """
    return (_one_hot(index, num_segments).t() @ values.to(torch.float64)).to(torch.float32)


def segment_sum_golden(values: torch.Tensor, index: torch.Tensor, num_segments: int) -> torch.Tensor:
    """``(R, N)`` fp64 exact-as-fp64 segment sums, the accuracy yardstick."""
    return _one_hot(index, num_segments).t() @ values.to(torch.float64)


class _TableLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, table, index):
        ctx.save_for_backward(index)
        ctx.num_rows, ctx.dtype = table.shape[0], table.dtype
        return table[index.long()]

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        return segment_sum_golden(grad, index, ctx.num_rows).to(ctx.dtype), None


def table_lookup_reference(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``table[index]``: (R, N) table, (M,) integer index with repeats -> (M, N) in the table's dtype.

    The backward sums the gradient rows of each table row (a segment sum in fp64 rounded once to the
    table dtype), deterministic unlike ``index_select``'s scatter-add backward. Not the packed-row
    copy :func:`flowlock.ops.rows.reference.gather_rows_reference`, whose indices are unique and whose
    backward is a scatter copy.
    """
    return _TableLookup.apply(table, index)


def fold_partials_reference(partials: torch.Tensor, group: int) -> torch.Tensor:
    """PyTorch spec of ``fold_partials``' order: fp32 ``(T, ...)`` -> ``(...)``, bitwise equal to it.

    Each level sums groups of ``group`` consecutive rows left to right in fp32, starting from the
    group's first row; levels repeat until one row is left (at least one level runs).
    """
    rows = list(partials.to(torch.float32).unbind(0))
    while True:
        sums = []
        for first in range(0, len(rows), group):
            acc = rows[first].clone()
            for row in rows[first + 1:first + group]:
                acc = acc + row
            sums.append(acc)
        rows = sums
        if len(rows) == 1:
            return rows[0]
