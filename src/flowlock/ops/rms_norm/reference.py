"""PyTorch spec of rms_norm and rms_norm_modulate, and their FP64 goldens.

Rounding points, measured on torch 2.13 (CPU, fused ``rms_norm``): ``rstd = rsqrt(mean(x²) + eps)``
and ``(x * rstd) * weight`` are computed in fp32 and rounded **once** to ``x.dtype`` (the normalized
value is not rounded before the weight multiply). The modulation follows diffusers' eager code in
``x.dtype``: ``1 + scale`` rounded, the product rounded, ``+ shift`` rounded.
"""

from __future__ import annotations

import torch

from flowlock.ops._rounding import st_round
from flowlock.ops.segment_sum.reference import table_lookup_reference


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``torch.nn.functional.rms_norm`` over the last dim (the eager spec itself)."""
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)


def rms_norm_golden(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype | None = None
                    ) -> torch.Tensor:
    """FP64 RMSNorm rounded to ``dtype`` (default ``x.dtype``) only at the output (straight-through);
    returns fp64. Pass fp64 leaves and the model ``dtype`` to get fp64 gradients."""
    xd = x.to(torch.float64)
    rstd = torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
    return st_round(xd * rstd * weight.to(torch.float64), dtype or x.dtype)


def _rows(x: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x (..., S, H)`` as ``(B*S, H)`` rows and the per-row table index ``(B*S,)``."""
    s, h = index.shape[0], x.shape[-1]
    rows = x.reshape(-1, h)
    return rows, index.repeat(rows.shape[0] // s if s else 0)


def modulate_reference(n: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, index: torch.Tensor
                       ) -> torch.Tensor:
    """Diffusers' ``n * (1 + scale[i]) + shift[i]`` in ``n.dtype``; a float32 table (holding values
    representable in ``n.dtype``) is rounded where eager rounds its ``n.dtype`` table."""
    rows, per_row = _rows(n, index)
    dt = n.dtype
    one_plus = (1.0 + table_lookup_reference(scale, per_row)).to(dt)
    # the sum is formed in n's shape: a tensor of its own, not a view (see gate_residual_reference)
    return (rows * one_plus).reshape(n.shape) + table_lookup_reference(shift, per_row).to(dt).reshape(n.shape)


def rms_norm_modulate_reference(x: torch.Tensor, weight: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
                                index: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm(x) * (1 + scale[index]) + shift[index]`` at eager's rounding points."""
    return modulate_reference(rms_norm_reference(x, weight, eps), shift, scale, index)


def rms_norm_modulate_golden(x: torch.Tensor, weight: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
                             index: torch.Tensor, eps: float, dtype: torch.dtype | None = None) -> torch.Tensor:
    """FP64 with rounding to ``dtype`` (default ``x.dtype``) at the normalized value, ``1 + scale``, the
    product and the sum (straight-through)."""
    dt = dtype or x.dtype
    n = rms_norm_golden(x, weight, eps, dt)
    rows, per_row = _rows(n, index)
    one_hot = torch.nn.functional.one_hot(per_row.long(), shift.shape[0]).to(torch.float64)
    scale_rows = one_hot @ scale.to(torch.float64)
    shift_rows = one_hot @ shift.to(torch.float64)
    product = st_round(rows * st_round(1.0 + scale_rows, dt), dt)
    return st_round(product + shift_rows, dt).reshape(x.shape)
