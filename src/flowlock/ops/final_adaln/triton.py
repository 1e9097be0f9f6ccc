"""Autograd node of ``final_adaln_out``: the AdaLN projection launchers (2H outputs) and the
``rms_norm`` launchers with modulation, composed so the table gradient stays FP32 in between."""

from __future__ import annotations

import torch

from flowlock.ops.adaln.triton import adaln_table_bwd, adaln_table_fwd, silu_act
from flowlock.ops.rms_norm.triton import rms_norm_bwd, rms_norm_fwd


class FinalAdalnOutFunction(torch.autograd.Function):
    """One node: x (..., S, H), temb (T, E), norm_weight (H,), weight (2H, E), bias (2H,) -> like x."""

    @staticmethod
    def forward(ctx, x, temb, norm_weight, weight, bias, timestep_indices, eps):
        act = silu_act(temb)
        table = adaln_table_fwd(act, weight, bias)
        h = x.shape[-1]
        y, rstd = rms_norm_fwd(x, norm_weight, eps, table[:, :h], table[:, h:], timestep_indices)
        ctx.save_for_backward(x, temb, act, norm_weight, weight, table, rstd, timestep_indices)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, temb, act, norm_weight, weight, table, rstd, timestep_indices = ctx.saved_tensors
        h = x.shape[-1]
        dx, d_norm_weight, d_shift, d_scale = rms_norm_bwd(dy, x, norm_weight, rstd, table[:, :h], table[:, h:],
                                                           timestep_indices)
        # The FP32 shift/scale sums go straight into the projection backward, never through BF16.
        need = ctx.needs_input_grad
        d_temb = d_weight = d_bias = None
        if need[1] or need[3] or need[4]:
            d_temb, d_weight, d_bias = adaln_table_bwd(torch.cat([d_shift, d_scale], dim=1), temb, act, weight,
                                                       need[1], need[3] or need[4])
        return dx, d_temb, d_norm_weight.to(norm_weight.dtype), d_weight, d_bias, None, None
