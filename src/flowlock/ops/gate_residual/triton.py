"""Triton gated residual ``residual + gate[index] * y``: elementwise, eager's two roundings, no FMA.

d_residual is the incoming gradient; d_y = ``g * gate[index]`` rounded once, exactly as eager's
product backward; d_gate is a segment sum of ``g * y`` over all ``(batch x S)`` rows with
``segment_sum``'s bits (fp32 sums of exact products over fixed 64-row tiles, folded ascending). One
backward launch writes d_y and the d_gate tile partials, then the shared fold runs.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from flowlock.config import LaunchConfig, config_for, config_on
from flowlock.ops._fp_bits import from_f32, round_f32, to_f32
from flowlock.ops._kernel_op import kernel_op
from flowlock.ops._launch import fast_launch
from flowlock.ops._triton_utils import traced
from flowlock.ops.segment_sum.fold import fold_partials
from flowlock.ops.segment_sum.triton import only_segment, segment_partials

_TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@fast_launch
@triton.jit
def _gate_residual_kernel(
    residual_ptr, y_ptr, gate_ptr, index_ptr, out_ptr, M, H, S, stride_gate,
    DTYPE: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """``out = round(residual + round(gate[i] * y))`` with ``i = index[row % S]``."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    row_mask = rows < M
    mask = row_mask[:, None] & (cols < H)[None, :]
    offs = rows[:, None] * H + cols[None, :]
    seg = tl.load(index_ptr + rows % S, mask=row_mask, other=0).to(tl.int64)
    gate = to_f32(tl.load(gate_ptr + seg[:, None] * stride_gate + cols[None, :], mask=mask, other=0.0))
    out = round_f32(gate * to_f32(tl.load(y_ptr + offs, mask=mask, other=0.0)), DTYPE)
    out = round_f32(to_f32(tl.load(residual_ptr + offs, mask=mask, other=0.0)) + out, DTYPE)
    tl.store(out_ptr + offs, from_f32(out, DTYPE), mask=mask)


@fast_launch
@triton.jit
def _gate_residual_bwd_kernel(
    g_ptr, y_ptr, gate_ptr, index_ptr, dy_ptr, partials_ptr, M, H, R, S, stride_gate,
    DTYPE: tl.constexpr, ONE_SEGMENT: tl.constexpr, TILE_ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One segment-sum tile of the backward: ``dy = round(gate[i] * g)`` for its elements and the
    tile's d_gate partials ``Σ g * y`` per segment, reduced exactly as ``segment_sum_partials``
    reduces ``values=g, other=y`` (same tile, same config, same shared reduction code)."""
    tile = tl.program_id(0)
    first = tile.to(tl.int64) * TILE_ROWS
    rows = first + tl.arange(0, TILE_ROWS)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < H
    mask = row_mask[:, None] & col_mask[None, :]
    # Registers are the limit here (segment_sum's own kernel already uses all of them on sm90): segments
    # as int32 (they are < R) and offsets within the tile as int32 from one int64 tile base.
    segment = tl.load(index_ptr + rows % S, mask=row_mask, other=-1).to(tl.int32)
    only = only_segment(segment, R, ONE_SEGMENT)
    # gate[i] per row, one gate row at a time: a (BLOCK_N,) load per segment instead of a gather's
    # (TILE_ROWS, BLOCK_N) pointers, which would not fit beside the partials' registers.
    gate = tl.zeros([TILE_ROWS, BLOCK_N], dtype=tl.float32)
    gate_row_ptrs = gate_ptr + cols
    for r in range(R):
        gate_row = to_f32(tl.load(gate_row_ptrs, mask=col_mask, other=0.0))
        gate = tl.where(segment[:, None] == r, gate_row[None, :], gate)
        # Advance the pointer rather than forming r * stride_gate, which could pass 2^31 in int32.
        gate_row_ptrs += stride_gate
    offs = tl.arange(0, TILE_ROWS)[:, None] * H + cols[None, :]
    g = to_f32(tl.load(g_ptr + first * H + offs, mask=mask, other=0.0))
    tl.store(dy_ptr + first * H + offs, from_f32(round_f32(gate * g, DTYPE), DTYPE), mask=mask)
    v = g * to_f32(tl.load(y_ptr + first * H + offs, mask=mask, other=0.0))
    segment_partials(v, segment, only, partials_ptr + tile.to(tl.int64) * R * H + cols, R, H, col_mask)


@functools.cache
def _fwd_args(dtype: torch.dtype, device: torch.device) -> tuple[int, int, dict]:
    """``(ROWS, BLOCK_H, the forward's keyword arguments)``: the frozen config read once per (dtype,
    device), not field by field on every call."""
    cfg = config_on("gate_residual", dtype, device)
    # Eager rounds the product before adding the residual: no fused multiply-add.
    return cfg["ROWS"], cfg["BLOCK_H"], dict(DTYPE=_TL_DTYPE[dtype], ROWS=cfg["ROWS"], BLOCK_H=cfg["BLOCK_H"],
                                             num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                                             enable_fp_fusion=False)


def gate_residual_fwd(residual: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, index: torch.Tensor
                      ) -> torch.Tensor:
    """``residual + gate[index] * y`` for contiguous ``(..., S, H)`` tensors. Trusted: not validated."""
    h = y.shape[-1]
    m = y.numel() // h if h else 0
    out = torch.empty_like(y)
    if m == 0:
        return out
    rows, block_h, kwargs = _fwd_args(y.dtype, y.device)
    _gate_residual_kernel[(-(-m // rows), -(-h // block_h))](
        residual, y, gate, index, out, m, h, index.shape[0], gate.stride(0), **kwargs)
    return out


def gate_residual_bwd(dout: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, index: torch.Tensor,
                      config: LaunchConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d_y like y, d_gate (R, H) fp32)``; ``dout`` contiguous. Trusted: inputs are not validated.

    One launch writes d_y and the d_gate tile partials (both read ``dout`` once); the partials are
    folded by the shared ``fold_partials``, so d_gate has ``segment_sum``'s bits. ``config``: a test's
    override of the frozen ``segment_sum_partials`` config, whose tiles this launch shares.
    """
    h, s, r = y.shape[-1], index.shape[0], gate.shape[0]
    m = y.numel() // h if h else 0
    dy = torch.empty_like(y)
    cfg = config or config_for("segment_sum_partials", y)
    tiles = max(-(-m // cfg["TILE_ROWS"]), 1)
    partials = torch.empty((tiles, r, h), dtype=torch.float32, device=y.device)
    if h > 0:
        _gate_residual_bwd_kernel[(tiles, -(-h // cfg["BLOCK_N"]))](
            dout, y, gate, index, dy, partials, m, h, r, max(s, 1), gate.stride(0),
            DTYPE=_TL_DTYPE[y.dtype], ONE_SEGMENT=bool(cfg["ONE_SEGMENT"]), TILE_ROWS=cfg["TILE_ROWS"],
            BLOCK_N=cfg["BLOCK_N"],
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return dy, fold_partials(partials)


@kernel_op("flowlock::gate_residual_fwd")
def _gate_residual_fwd_op(residual: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, index: torch.Tensor
                          ) -> torch.Tensor:
    """The forward as one opaque op, so torch.compile and CUDA graphs replay the same launch."""
    return gate_residual_fwd(residual, gate, y, index)


@_gate_residual_fwd_op.register_fake
def _(residual, gate, y, index):
    return residual.new_empty(residual.shape)


@kernel_op("flowlock::gate_residual_bwd")
def _gate_residual_bwd_op(dout: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, index: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d_y, d_gate in gate.dtype)``."""
    dy, dgate = gate_residual_bwd(dout, gate, y, index)
    return dy, dgate.to(gate.dtype)


@_gate_residual_bwd_op.register_fake
def _(dout, gate, y, index):
    return y.new_empty(y.shape), gate.new_empty(gate.shape)


def gate_residual_forward(residual: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, index: torch.Tensor
                          ) -> torch.Tensor:
    """The forward as every path runs it: the registered custom op while tracing, else the launcher."""
    return (_gate_residual_fwd_op if traced() else gate_residual_fwd)(residual, gate, y, index)


class GateResidualFunction(torch.autograd.Function):
    """Autograd boundary of the gated residual; d_residual is the incoming gradient itself."""

    @staticmethod
    def forward(ctx, residual, gate, y, index):
        ctx.save_for_backward(gate, y, index)
        return gate_residual_forward(residual, gate, y, index)

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
