"""Triton kernels for ``qk_norm_rope``: per-head RMSNorm then rotate-half RoPE, fused.

Both kernels take ``(token, head)`` rows of D channels (any D: a row is one power-of-two block,
masked past D; any even ``R <= D``) in 2-D blocks of ``BLOCK_ROWS`` / ``SUB_ROWS`` rows, so a
program moves whole cache lines of many rows at once; every row is reduced over its own channels
only, by the same ``tl.sum`` tree whatever its position in the block, so a row's bits depend on its
values alone. The rotate-half partner of channel ``j`` (``j ± R/2``) is recomputed from its own
load rather than shuffled across registers, so every value is rounded exactly where eager rounds it
in the input dtype (bf16 or fp16; fp32 rounds nowhere). Backward: one program per fixed tile of
``TILE_ROWS`` rows (a layout constant, never derived from the token count or the GPU), ``SUB_ROWS``
at a time; dx rows are pure, and the weight gradient is a per-tile float32 partial (each sub-block's
rows summed by one fixed tree, sub-blocks ascending) folded over tiles by the shared fixed-order
multi-level ``fold_partials``, then rounded once to the weight's dtype: no atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flowlock.config import config_for
from flowlock.ops._fp_bits import from_f32, round_f32, to_f32
from flowlock.ops._kernel_op import kernel_op
from flowlock.ops._launch import fast_launch
from flowlock.ops._triton_utils import traced
from flowlock.ops.segment_sum.fold import fold_partials


@triton.jit
def _inv_rms(x, mask, D, eps):
    # x (rows, BLOCK_D): one reciprocal RMS per row, over that row's channels
    ss = tl.sum(tl.where(mask, x * x, 0.0), axis=1)
    return tl.math.div_rn(1.0, tl.math.sqrt_rn(tl.math.div_rn(ss, D * 1.0) + eps))


@triton.jit
def _channels(R, BLOCK_D: tl.constexpr):
    """``(j, partner, rotary, sign)`` over one row's channel block: the rotate-half partner of each
    rotary channel and the sign of the partner's term (rotate_half puts -x at j < R/2)."""
    j = tl.arange(0, BLOCK_D)
    half = R // 2
    rotary = j < R
    partner = tl.where(j < half, j + half, j - half)
    partner = tl.where(rotary, partner, j)
    sign = tl.where(j < half, 1.0, -1.0)
    return j, partner, rotary, sign


@fast_launch
@triton.jit
def _qk_norm_rope_fwd_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, ROWS, S, HEADS, D, R, eps,
                             BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    j, partner, rotary, sign = _channels(R, BLOCK_D)
    row_ok = rows < ROWS
    mask = row_ok[:, None] & (j < D)[None, :]
    rmask = mask & rotary[None, :]
    pos = ((rows // HEADS) % S)[:, None] * R
    dtype = out_ptr.dtype.element_ty
    src = x_ptr + rows[:, None] * D
    x = to_f32(tl.load(src + j[None, :], mask=mask, other=0.0))
    inv_rms = _inv_rms(x, mask, D, eps)[:, None]
    w = to_f32(tl.load(w_ptr + j, mask=j < D, other=0.0))[None, :]
    wp = to_f32(tl.load(w_ptr + partner, mask=j < D, other=0.0))[None, :]
    y = round_f32((x * inv_rms) * w, dtype)
    xp = to_f32(tl.load(src + partner[None, :], mask=mask, other=0.0))
    yp = round_f32((xp * inv_rms) * wp, dtype)
    rotated = -sign[None, :] * yp
    c = round_f32(tl.load(cos_ptr + pos + j[None, :], mask=rmask, other=0.0), dtype)
    sn = round_f32(tl.load(sin_ptr + pos + j[None, :], mask=rmask, other=0.0), dtype)
    rope = round_f32(round_f32(y * c, dtype) + round_f32(rotated * sn, dtype), dtype)
    out = tl.where(rotary[None, :], rope, y)
    tl.store(out_ptr + rows[:, None] * D + j[None, :], from_f32(out, dtype), mask=mask)


@fast_launch
@triton.jit
def _qk_norm_rope_bwd_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, g_ptr, dx_ptr, dw_part_ptr, ROWS, S, HEADS, D, R,
                             eps, TILE_ROWS: tl.constexpr, SUB_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    tile = tl.program_id(0)
    j, partner, rotary, sign = _channels(R, BLOCK_D)
    dtype = dx_ptr.dtype.element_ty
    w = to_f32(tl.load(w_ptr + j, mask=j < D, other=0.0))[None, :]
    dw = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for sub in range(0, TILE_ROWS, SUB_ROWS):
        rows = tile.to(tl.int64) * TILE_ROWS + sub + tl.arange(0, SUB_ROWS)
        mask = (rows < ROWS)[:, None] & (j < D)[None, :]
        rmask = mask & rotary[None, :]
        pos = ((rows // HEADS) % S)[:, None] * R
        at = rows[:, None] * D
        x = to_f32(tl.load(x_ptr + at + j[None, :], mask=mask, other=0.0))
        g = to_f32(tl.load(g_ptr + at + j[None, :], mask=mask, other=0.0))
        gp = to_f32(tl.load(g_ptr + at + partner[None, :], mask=rmask, other=0.0))
        c = round_f32(tl.load(cos_ptr + pos + j[None, :], mask=rmask, other=0.0), dtype)
        sp = round_f32(tl.load(sin_ptr + pos + partner[None, :], mask=rmask, other=0.0), dtype)
        dy = tl.where(rotary[None, :], g * c + sign[None, :] * (gp * sp), g)
        inv_rms = _inv_rms(x, mask, D, eps)[:, None]
        n = x * inv_rms
        dn = dy * w
        dot = tl.sum(tl.where(mask, dn * n, 0.0), axis=1)[:, None]
        dx = inv_rms * (dn - n * tl.math.div_rn(dot, D * 1.0))
        tl.store(dx_ptr + at + j[None, :], from_f32(round_f32(dx, dtype), dtype), mask=mask)
        dw = dw + tl.sum(tl.where(mask, dy * n, 0.0), axis=0)
    tl.store(dw_part_ptr + tile.to(tl.int64) * D + j, dw, mask=j < D)


def _block_d(d: int) -> int:
    """A head in one block: the next power of two ``>= d`` (``triton.next_power_of_2`` without its
    constexpr-call overhead on the host)."""
    return 1 << max(d - 1, 0).bit_length()


def qk_norm_rope_fwd(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     eps: float) -> torch.Tensor:
    """Trusted launcher: contiguous ``(B, S, heads, D)`` bf16 / fp16 / fp32, ``(D,)`` of x's dtype, fp32
    ``(S, R)`` -> like x."""
    b, s, heads, d = x.shape
    out = torch.empty_like(x)
    rows = b * s * heads
    if rows == 0:
        return out
    cfg = config_for("qk_norm_rope_fwd", x)
    block_rows = cfg["BLOCK_ROWS"]
    _qk_norm_rope_fwd_kernel[(-(-rows // block_rows),)](x, weight, cos, sin, out, rows, s, heads, d, cos.shape[1],
                                                        float(eps), BLOCK_ROWS=block_rows, BLOCK_D=_block_d(d),
                                                        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def qk_norm_rope_bwd(x, weight, cos, sin, eps, grad) -> tuple[torch.Tensor, torch.Tensor]:
    """Trusted launcher: ``(dx like x, dweight like weight)``; dweight = fixed ``TILE_ROWS``-row tile
    partials, folded by :func:`fold_partials` and rounded once to the weight's dtype (nearest even)."""
    grad = grad.contiguous()
    b, s, heads, d = x.shape
    rows = b * s * heads
    dx = torch.empty_like(x)
    cfg = config_for("qk_norm_rope_bwd", x)
    tile_rows = cfg["TILE_ROWS"]
    if tile_rows % cfg["SUB_ROWS"]:
        # a tile's last sub-block would run into the next tile and count those rows twice
        raise ValueError(f"qk_norm_rope_bwd: TILE_ROWS {tile_rows} must be a multiple of SUB_ROWS {cfg['SUB_ROWS']}")
    tiles = -(-rows // tile_rows)
    if tiles == 0:
        return dx, torch.zeros_like(weight)
    partials = torch.empty((tiles, d), dtype=torch.float32, device=x.device)
    _qk_norm_rope_bwd_kernel[(tiles,)](x, weight, cos, sin, grad, dx, partials, rows, s, heads, d,
                                       cos.shape[1], float(eps), TILE_ROWS=tile_rows, SUB_ROWS=cfg["SUB_ROWS"],
                                       BLOCK_D=_block_d(d), num_warps=cfg.num_warps,
                                       num_stages=cfg.num_stages)
    return dx, fold_partials(partials).to(weight.dtype)


@kernel_op("flowlock::qk_norm_rope_fwd")
def _qk_norm_rope_fwd_op(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         eps: float) -> torch.Tensor:
    """The forward as one opaque op, so torch.compile and CUDA graphs replay the same launch."""
    return qk_norm_rope_fwd(x, weight, cos, sin, eps)


@_qk_norm_rope_fwd_op.register_fake
def _(x, weight, cos, sin, eps):
    return x.new_empty(x.shape)


@kernel_op("flowlock::qk_norm_rope_bwd")
def _qk_norm_rope_bwd_op(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
                         grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dweight)`` as one opaque op (see :func:`qk_norm_rope_bwd`)."""
    return qk_norm_rope_bwd(x, weight, cos, sin, eps, grad)


@_qk_norm_rope_bwd_op.register_fake
def _(x, weight, cos, sin, eps, grad):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def qk_norm_rope_forward(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         eps: float) -> torch.Tensor:
    """The forward as every path runs it: the registered custom op while tracing, else the launcher."""
    return (_qk_norm_rope_fwd_op if traced() else qk_norm_rope_fwd)(x, weight, cos, sin, eps)


class QkNormRopeFunction(torch.autograd.Function):
    """Autograd boundary: gradients to ``x`` and ``weight`` (cos/sin are position tables)."""

    @staticmethod
    def forward(ctx, x, weight, cos, sin, eps):
        ctx.save_for_backward(x, weight, cos, sin)
        ctx.eps = eps
        return qk_norm_rope_forward(x, weight, cos, sin, eps)

    @staticmethod
    def backward(ctx, grad):
        x, weight, cos, sin = ctx.saved_tensors
        bwd = _qk_norm_rope_bwd_op if traced() else qk_norm_rope_bwd
        dx, dweight = bwd(x, weight, cos, sin, ctx.eps, grad)
        return dx, dweight, None, None, None
