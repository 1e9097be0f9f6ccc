"""Public gate_residual: validation, then the chosen backend."""

from __future__ import annotations

import torch

from flowlock.dispatch import backend_for
from flowlock.ops._graph import needs_graph
from flowlock.ops._triton_utils import traced
from flowlock.ops._validate import FLOAT_DTYPES, check_index, check_tensor
from flowlock.ops.gate_residual.opaque import gate_residual_reference_op
from flowlock.ops.gate_residual.reference import gate_residual_reference
from flowlock.ops.gate_residual.triton import GateResidualFunction, gate_residual_forward
from flowlock.ops.rms_norm._tables import check_contiguous, check_table


def gate_residual(residual: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, index: torch.Tensor, *,
                  check_indices: bool = True) -> torch.Tensor:
    """``residual + gate[index] * y``, per row, as diffusers' MiniMax-H3 block computes it.

    Args:
        residual: ``(..., S, H)`` float32, bfloat16 or float16, contiguous.
        gate: ``(R, H)`` of ``residual.dtype`` or float32 holding ``residual.dtype`` values (a column
            view of the ``adaln_table`` output qualifies: unit column stride, any row stride).
        y: like ``residual`` (same shape, dtype, device), contiguous.
        index: ``(S,)`` int32/int64 in ``[0, R)`` (checked, never clamped, unless ``check_indices=False``).

    Returns:
        ``like residual``: the product rounded to ``residual.dtype``, then the sum rounded (no FMA).

    Guarantees: forward and d_y are bitwise equal to eager ``residual + gate.index_select(0, index) * y``
    (bf16, fp16, fp32); d_residual is the incoming gradient; d_gate is a deterministic fp32 segment sum
    of ``g * y`` over all ``(batch x S)`` rows (fixed 64-row tiles folded ascending), rounded once to
    ``gate.dtype`` (kept fp32 for a float32 gate). Rows are pure (batch-invariant).
    """
    check_tensor("residual", residual, dtypes=FLOAT_DTYPES)
    shape, device = residual.shape, residual.device
    if len(shape) < 2:
        raise ValueError(f"residual must have at least 2 dims, got shape {tuple(shape)}")
    check_contiguous("residual", residual)
    check_tensor("y", y, dtypes=(residual.dtype,), shape=shape, device=device)
    check_contiguous("y", y)
    check_table("gate", gate, dtype=residual.dtype, width=shape[-1], device=device)
    check_index("index", index, length=shape[-2], upper=gate.shape[0], device=device, check_range=check_indices)
    # The checks above put every tensor on residual's device: the backend follows from it alone.
    if backend_for("gate_residual", residual) == "reference":
        return (gate_residual_reference_op if traced() else gate_residual_reference)(residual, gate, y, index)
    if needs_graph(residual, gate, y):
        return GateResidualFunction.apply(residual, gate, y, index)
    return gate_residual_forward(residual, gate, y, index)
