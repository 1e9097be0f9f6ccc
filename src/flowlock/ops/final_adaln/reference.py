"""PyTorch spec and FP64 golden of ``final_adaln_out`` (diffusers ``MiniMaxH3AdaLayerNormOut``).

Rounding points, where the model stores a value in its dtype (bf16, fp16; fp32 rounds nowhere):
the activation ``silu(temb)`` cast to the weight's dtype, the ``(T, 2H)`` projection table, the
normalized ``rms_norm(x) * norm_weight``, ``1 + scale``, the product and the sum. The table is held
in FP32 (values of the model's dtype) so its gradient reaches the projection backward in FP32.
"""

from __future__ import annotations

import torch

from flowlock.ops.adaln.reference import adaln_projection_golden, adaln_projection_reference
from flowlock.ops.rms_norm.reference import rms_norm_modulate_golden, rms_norm_modulate_reference


def final_adaln_out_reference(x: torch.Tensor, temb: torch.Tensor, norm_weight: torch.Tensor,
                              weight: torch.Tensor, bias: torch.Tensor, timestep_indices: torch.Tensor,
                              eps: float) -> torch.Tensor:
    """``rms_norm(x) * (1 + scale[ti]) + shift[ti]`` with ``[shift | scale]`` the ``(T, 2H)`` table."""
    table = adaln_projection_reference(temb, weight, bias)
    h = x.shape[-1]
    return rms_norm_modulate_reference(x, norm_weight, table[:, :h], table[:, h:], timestep_indices, eps)


def final_adaln_out_golden(x: torch.Tensor, temb: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
                           bias: torch.Tensor, timestep_indices: torch.Tensor, eps: float,
                           dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """FP64 golden: every rounding point of the spec rounds to ``dtype`` (the model's), straight-through;
    pass FP64 leaves to get FP64 gradients."""
    table = adaln_projection_golden(temb, weight, bias, dtype)
    h = x.shape[-1]
    return rms_norm_modulate_golden(x, norm_weight, table[:, :h], table[:, h:], timestep_indices, eps, dtype)
