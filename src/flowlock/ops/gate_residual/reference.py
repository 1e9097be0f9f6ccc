"""PyTorch spec of gate_residual (diffusers' eager expression) and its FP64 golden."""

from __future__ import annotations

import torch

from flowlock.ops._rounding import st_round
from flowlock.ops.segment_sum.reference import table_lookup_reference


def _per_row(y: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    s = index.shape[0]
    return index.repeat(y.numel() // (s * y.shape[-1]) if s and y.shape[-1] else 0)


def gate_residual_reference(residual: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, index: torch.Tensor
                            ) -> torch.Tensor:
    """``residual + gate[index] * y`` in ``residual.dtype`` (a float32 gate holding ``residual.dtype``
    values is cast exactly first); the gather's backward is a deterministic fp64 segment sum."""
    h = y.shape[-1]
    gate_rows = table_lookup_reference(gate, _per_row(y, index)).to(residual.dtype)
    # the sum is formed in residual's shape, so the result is a tensor of its own, not a view (FSDP2 warns
    # on a unit returning a view: an in-place op on it would drop the unit's pre-backward hook)
    return residual + (gate_rows * y.reshape(-1, h)).reshape(residual.shape)


def gate_residual_golden(residual: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, index: torch.Tensor,
                         dtype: torch.dtype | None = None) -> torch.Tensor:
    """FP64 with the product and the sum rounded to ``dtype`` (default ``residual.dtype``), straight-through."""
    dt = dtype or residual.dtype
    h = y.shape[-1]
    one_hot = torch.nn.functional.one_hot(_per_row(y, index).long(), gate.shape[0]).to(torch.float64)
    product = st_round((one_hot @ gate.to(torch.float64)) * y.reshape(-1, h).to(torch.float64), dt)
    return st_round(residual.reshape(-1, h).to(torch.float64) + product, dt).reshape(residual.shape)
