"""Autograd node of ``final_adaln_out``: the AdaLN projection launchers (2H outputs) and the
``rms_norm`` launchers with modulation, composed so the table gradient stays FP32 in between."""

from __future__ import annotations

import torch

from flowlock.ops._kernel_op import kernel_op
from flowlock.ops._triton_utils import traced
from flowlock.ops.adaln.triton import projection, projection_vjp
from flowlock.ops.rms_norm.triton import rms_norm_bwd, rms_norm_fwd


def _norm_fwd(x: torch.Tensor, norm_weight: torch.Tensor, table: torch.Tensor, timestep_indices: torch.Tensor,
              eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    h = x.shape[-1]
    # The kernel reads H columns of each shift row at the row stride, so the whole [shift | scale] table
    # (same pointer, same row stride as table[:, :h]) stands for shift without a slicing op.
    return rms_norm_fwd(x, norm_weight, eps, table, table[:, h:], timestep_indices)


def _norm_bwd(dy: torch.Tensor, x: torch.Tensor, norm_weight: torch.Tensor, rstd: torch.Tensor, table: torch.Tensor,
              timestep_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    h = x.shape[-1]
    dx, d_norm_weight, d_shift, d_scale = rms_norm_bwd(dy, x, norm_weight, rstd, table[:, :h], table[:, h:],
                                                       timestep_indices)
    return dx, d_norm_weight.to(norm_weight.dtype), torch.cat([d_shift, d_scale], dim=1)


@kernel_op("flowlock::final_adaln_norm_fwd")
def _final_adaln_norm_fwd_op(x: torch.Tensor, norm_weight: torch.Tensor, table: torch.Tensor,
                             timestep_indices: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, rstd)``: the norm modulated by ``table = [shift | scale]`` ``(T, 2H)`` FP32, one opaque op."""
    return _norm_fwd(x, norm_weight, table, timestep_indices, eps)


@_final_adaln_norm_fwd_op.register_fake
def _(x, norm_weight, table, timestep_indices, eps):
    return x.new_empty(x.shape), x.new_empty((x.numel() // x.shape[-1],), dtype=torch.float32)


@kernel_op("flowlock::final_adaln_norm_bwd")
def _final_adaln_norm_bwd_op(dy: torch.Tensor, x: torch.Tensor, norm_weight: torch.Tensor, rstd: torch.Tensor,
                             table: torch.Tensor, timestep_indices: torch.Tensor
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, d_norm_weight, d_table (T, 2H) fp32)``: the FP32 shift/scale sums, never rounded."""
    return _norm_bwd(dy, x, norm_weight, rstd, table, timestep_indices)


@_final_adaln_norm_bwd_op.register_fake
def _(dy, x, norm_weight, rstd, table, timestep_indices):
    return x.new_empty(x.shape), norm_weight.new_empty(norm_weight.shape), table.new_empty(table.shape)


def final_forward(x: torch.Tensor, temb: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor, timestep_indices: torch.Tensor, eps: float
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(act, table, y, rstd)``: the launches of :class:`FinalAdalnOutFunction`'s forward, which a call
    that records no autograd node makes directly (same launchers, same bits)."""
    act, table = projection(temb, weight, bias)
    y, rstd = (_final_adaln_norm_fwd_op if traced() else _norm_fwd)(x, norm_weight, table, timestep_indices, eps)
    return act, table, y, rstd


class FinalAdalnOutFunction(torch.autograd.Function):
    """One node: x (..., S, H), temb (T, E), norm_weight (H,), weight (2H, E), bias (2H,) -> like x."""

    @staticmethod
    def forward(ctx, x, temb, norm_weight, weight, bias, timestep_indices, eps):
        act, table, y, rstd = final_forward(x, temb, norm_weight, weight, bias, timestep_indices, eps)
        ctx.save_for_backward(x, temb, act, norm_weight, weight, table, rstd, timestep_indices)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, temb, act, norm_weight, weight, table, rstd, timestep_indices = ctx.saved_tensors
        norm_bwd = _final_adaln_norm_bwd_op if traced() else _norm_bwd
        dx, d_norm_weight, d_table = norm_bwd(dy.contiguous(), x, norm_weight, rstd, table, timestep_indices)
        need = ctx.needs_input_grad
        # The FP32 shift/scale gradient goes straight into the projection backward.
        d_temb, d_weight, d_bias = projection_vjp(d_table, temb, act, weight, need[1], need[3] or need[4])
        return dx, d_temb, d_norm_weight, d_weight, d_bias, None, None
