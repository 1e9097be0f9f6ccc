"""Public rms_norm and rms_norm_modulate: validation, then the chosen backend."""

from __future__ import annotations

import torch

from flowlock.dispatch import backend_for
from flowlock.ops._graph import needs_graph
from flowlock.ops._triton_utils import traced
from flowlock.ops._validate import FLOAT_DTYPES, check_index, check_tensor
from flowlock.ops.rms_norm._tables import check_contiguous, check_eps, check_table
from flowlock.ops.rms_norm.opaque import rms_norm_modulate_reference_op, rms_norm_reference_op
from flowlock.ops.rms_norm.reference import rms_norm_modulate_reference, rms_norm_reference
from flowlock.ops.rms_norm.triton import (
    RMSNormFunction,
    RMSNormModulateFunction,
    rms_norm_forward,
    rms_norm_modulate_forward,
)


def _check_x_weight(x: object, weight: object, min_ndim: int) -> torch.device:
    """Check ``x`` and ``weight``; return the device every other argument must share."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.ndim < min_ndim:
        raise ValueError(f"x must have at least {min_ndim} dims, got shape {tuple(x.shape)}")
    check_contiguous("x", x)
    device = x.device
    check_tensor("weight", weight, dtypes=(x.dtype,), shape=(x.shape[-1],), device=device)
    check_contiguous("weight", weight)
    return device


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, as ``torch.nn.RMSNorm(H, eps)`` with weight ``weight``.

    Args:
        x: ``(..., H)`` float32, bfloat16 or float16, contiguous.
        weight: ``(H,)`` of ``x.dtype``, contiguous.
        eps: finite, ``>= 0``.

    Returns:
        ``like x``: ``(x * rstd) * weight`` computed in fp32 and rounded once to ``x.dtype``, with
        ``rstd = 1 / sqrt(mean(x²) + eps)`` (PyTorch 2.13's rounding points; the reduction order
        differs, so results agree with eager to about one unit in the last place).

    Guarantees (Triton): each row is a pure function of that row (batch-invariant); dx is row-pure;
    dweight sums the rows over fixed 64-row tiles folded in a fixed multi-level order (repeatable).
    """
    _check_x_weight(x, weight, 1)
    eps = check_eps(eps)
    # weight was checked to be on x's device: the backend follows from x alone.
    if backend_for("rms_norm", x) == "reference":
        return (rms_norm_reference_op if traced() else rms_norm_reference)(x, weight, eps)
    if needs_graph(x, weight):
        return RMSNormFunction.apply(x, weight, eps)
    return rms_norm_forward(x, weight, eps)[0]


def rms_norm_modulate(x: torch.Tensor, weight: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
                      index: torch.Tensor, eps: float, *, check_indices: bool = True) -> torch.Tensor:
    """``n * (1 + scale[index]) + shift[index]`` with ``n = rms_norm(x, weight, eps)``, per row.

    Args:
        x: ``(..., S, H)`` float32, bfloat16 or float16, contiguous; leading dims broadcast against
            the per-position ``index``.
        weight: ``(H,)`` of ``x.dtype``.
        shift, scale: ``(R, H)`` of ``x.dtype`` or float32 holding ``x.dtype`` values (the
            ``adaln_table`` output); unit column stride, any row stride (column views of the
            ``(3T, 6H)`` table qualify).
        index: ``(S,)`` int32/int64 in ``[0, R)`` (checked, never clamped, unless ``check_indices=False``).
        eps: finite, ``>= 0``.

    Returns:
        ``like x``. ``1 + scale``, the product and the sum are each rounded to ``x.dtype`` exactly
        where diffusers' eager code rounds, without fused multiply-adds: given the same ``n`` and
        table the modulation is bitwise equal to ``MiniMaxH3TransformerBlock`` / ``norm_out``.

    Guarantees (Triton): rows pure (batch-invariant); dx row-pure; dweight, dshift, dscale are fp32
    sums over fixed 64-row tiles of all ``(batch x S)`` rows, folded in a fixed order (repeatable), rounded
    once to the table's dtype (kept fp32 for a float32 table).
    """
    device = _check_x_weight(x, weight, 2)
    s, h = x.shape[-2:]
    rows = check_table("shift", shift, dtype=x.dtype, width=h, device=device).shape[0]
    check_table("scale", scale, dtype=shift.dtype, width=h, device=device, rows=rows)
    check_index("index", index, length=s, upper=rows, device=device, check_range=check_indices)
    eps = check_eps(eps)
    # The checks above put every tensor on x's device: the backend follows from x alone.
    if backend_for("rms_norm_modulate", x) == "reference":
        spec = rms_norm_modulate_reference_op if traced() else rms_norm_modulate_reference
        return spec(x, weight, shift, scale, index, eps)
    if needs_graph(x, weight, shift, scale):
        return RMSNormModulateFunction.apply(x, weight, shift, scale, index, eps)
    return rms_norm_modulate_forward(x, weight, shift, scale, index, eps)[0]
