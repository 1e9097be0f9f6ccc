"""Triton gated residual ``residual + gate[index] * y``: elementwise, eager's two roundings, no FMA.

d_residual is the incoming gradient; d_y = ``g * gate[index]`` rounded once, exactly as eager's
product backward; d_gate is a segment sum of ``g * y`` over all ``(batch x S)`` rows through
``segment_sum`` (fp32 sums of exact products over fixed 64-row tiles, folded ascending).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flowlock.config import launch_config
from flowlock.ops._fp_bits import from_f32, round_f32, to_f32
from flowlock.ops._triton_utils import arch_of, traced
from flowlock.ops.segment_sum.triton import segment_sum_fwd

_TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _gate_residual_kernel(
    a_ptr, b_ptr, gate_ptr, index_ptr, out_ptr, M, H, S, stride_gate,
    WITH_RESIDUAL: tl.constexpr, DTYPE: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """``out = round(a + round(gate[i] * b))`` when ``WITH_RESIDUAL`` (forward: a = residual, b = y),
    else ``out = round(gate[i] * b)`` (backward: b = g); ``i = index[row % S]``."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    row_mask = rows < M
    mask = row_mask[:, None] & (cols < H)[None, :]
    offs = rows[:, None] * H + cols[None, :]
    seg = tl.load(index_ptr + rows % S, mask=row_mask, other=0).to(tl.int64)
    gate = to_f32(tl.load(gate_ptr + seg[:, None] * stride_gate + cols[None, :], mask=mask, other=0.0))
    out = round_f32(gate * to_f32(tl.load(b_ptr + offs, mask=mask, other=0.0)), DTYPE)
    if WITH_RESIDUAL:
        out = round_f32(to_f32(tl.load(a_ptr + offs, mask=mask, other=0.0)) + out, DTYPE)
    tl.store(out_ptr + offs, from_f32(out, DTYPE), mask=mask)


def _launch(a: torch.Tensor | None, b: torch.Tensor, gate: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    h, s = b.shape[-1], index.shape[0]
    m = b.numel() // h if h else 0
    out = torch.empty_like(b)
    if out.numel() == 0:
        return out
    cfg = launch_config("gate_residual", b.dtype, arch_of(b))
    grid = (triton.cdiv(m, cfg["ROWS"]), triton.cdiv(h, cfg["BLOCK_H"]))
    _gate_residual_kernel[grid](
        b if a is None else a, b, gate, index, out, m, h, s, gate.stride(0),
        WITH_RESIDUAL=a is not None, DTYPE=_TL_DTYPE[b.dtype], ROWS=cfg["ROWS"], BLOCK_H=cfg["BLOCK_H"],
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        # Eager rounds the product before adding the residual: no fused multiply-add.
        enable_fp_fusion=False,
    )
    return out


def gate_residual_fwd(residual: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, index: torch.Tensor
                      ) -> torch.Tensor:
    """``residual + gate[index] * y`` for contiguous ``(..., S, H)`` tensors. Trusted: not validated."""
    return _launch(residual, y, gate, index)


def gate_residual_bwd(dout: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, index: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d_y like y, d_gate (R, H) fp32)``; ``dout`` contiguous. Trusted: inputs are not validated."""
    dy = _launch(None, dout, gate, index)
    h = y.shape[-1]
    dgate = segment_sum_fwd(dout.reshape(-1, h), index, gate.shape[0], other=y.reshape(-1, h),
                            period=index.shape[0])
    return dy, dgate


@torch.library.custom_op("flowlock::gate_residual_fwd", mutates_args=())
def _gate_residual_fwd_op(residual: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, index: torch.Tensor
                          ) -> torch.Tensor:
    """The forward as one opaque op, so torch.compile and CUDA graphs replay the same launch."""
    return gate_residual_fwd(residual, gate, y, index)


@_gate_residual_fwd_op.register_fake
def _(residual, gate, y, index):
    return residual.new_empty(residual.shape)


@torch.library.custom_op("flowlock::gate_residual_bwd", mutates_args=())
def _gate_residual_bwd_op(dout: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, index: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d_y, d_gate in gate.dtype)``."""
    dy, dgate = gate_residual_bwd(dout, gate, y, index)
    return dy, dgate.to(gate.dtype)


@_gate_residual_bwd_op.register_fake
def _(dout, gate, y, index):
    return y.new_empty(y.shape), gate.new_empty(gate.shape)


class GateResidualFunction(torch.autograd.Function):
    """Autograd boundary of the gated residual; d_residual is the incoming gradient itself."""

    @staticmethod
    def forward(ctx, residual, gate, y, index):
        ctx.save_for_backward(gate, y, index)
        return (_gate_residual_fwd_op if traced() else gate_residual_fwd)(residual, gate, y, index)

    @staticmethod
    def backward(ctx, dout):
        gate, y, index = ctx.saved_tensors
        dout = dout.contiguous()
        if traced():
            dy, dgate = _gate_residual_bwd_op(dout, gate, y, index)
        else:
            dy, dgate = gate_residual_bwd(dout, gate, y, index)
            dgate = dgate.to(gate.dtype)
        return dout, dgate, dy, None
