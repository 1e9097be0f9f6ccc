"""PyTorch spec of the row gather and row scatter of a packed sequence.

Both ops are pure copies, so the spec is exact in every dtype and is its own FP64 golden. Each is an
autograd Function whose backward is the other copy: the gradient of a gather is a scatter of the
output gradient into zeros, never an accumulating ``index_add``/``scatter_add`` (indices are
unique, so no two gradient rows meet).
"""

from __future__ import annotations

import torch


def gather_rows_copy(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[:, index]`` as a new tensor: (B, S, H), (N,) -> (B, N, H)."""
    return x[:, index.long()].contiguous()


def scatter_rows_copy(parts: list[torch.Tensor], indices: list[torch.Tensor], seq_len: int) -> torch.Tensor:
    """Zeros of (B, seq_len, H) with ``out[:, indices[p]] = parts[p]``; indices unique and disjoint."""
    first = parts[0]
    out = first.new_zeros((first.shape[0], seq_len, first.shape[2]))
    for part, index in zip(parts, indices):
        out[:, index.long()] = part
    return out


class _GatherRowsReference(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, index):
        ctx.save_for_backward(index)
        ctx.seq_len = x.shape[1]
        return gather_rows_copy(x, index)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        return scatter_rows_copy([grad], [index], ctx.seq_len), None


class _ScatterRowsReference(torch.autograd.Function):
    @staticmethod
    def forward(ctx, seq_len, num_parts, *tensors):
        parts, indices = list(tensors[:num_parts]), list(tensors[num_parts:])
        ctx.save_for_backward(*indices)
        return scatter_rows_copy(parts, indices, seq_len)

    @staticmethod
    def backward(ctx, grad):
        indices = ctx.saved_tensors
        grads = tuple(gather_rows_copy(grad, index) for index in indices)
        return (None, None, *grads, *(None for _ in indices))


def gather_rows_reference(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Spec of :func:`flowlock.ops.rows.gather_rows`; differentiable, backward a scatter copy."""
    return _GatherRowsReference.apply(x, index)


def scatter_rows_reference(parts: list[torch.Tensor], indices: list[torch.Tensor], seq_len: int) -> torch.Tensor:
    """Spec of :func:`flowlock.ops.rows.scatter_rows`; differentiable, backward gather copies."""
    return _ScatterRowsReference.apply(seq_len, len(parts), *parts, *indices)


def gather_rows_golden(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """FP64 golden: the same copy on ``x`` taken as float64 (a copy rounds nothing)."""
    return gather_rows_reference(x.double(), index)


def scatter_rows_golden(parts: list[torch.Tensor], indices: list[torch.Tensor], seq_len: int) -> torch.Tensor:
    """FP64 golden: the same copy on the parts taken as float64."""
    return scatter_rows_reference([p.double() for p in parts], indices, seq_len)
