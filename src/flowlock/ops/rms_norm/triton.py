"""Triton RMSNorm with optional AdaLN modulation: row-pure forward, deterministic backward.

Forward: a fixed number of rows per program (a config constant), each row reduced on its own with a
fixed ``tl.sum`` tree over H, at PyTorch's rounding points (see ``reference.py``). Backward: two
launches. dx is row-pure (each row's own reduction over H), in the forward's row grid. dweight's
terms are summed per fixed 64-row tile, each column on its own over the tile's rows in ascending
chunks, one program per (tile, column block), into a tile partial; the partials are folded by the
shared fixed-order multi-level ``fold_partials``. Splitting the two fills the GPU at a few tiles
(a short sequence has 15), where one program per tile walking its rows one by one could not. The
modulation's table gradients are segment sums over all ``(batch x S)`` rows over the same tiles (one
paired ``segment_sum`` partials launch), whose partials sit beside dweight's so one fold reduces all
three.
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
from flowlock.ops.segment_sum.triton import num_tiles, write_segment_partials

_TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _modulation(n, shift_ptr, scale_ptr, index_ptr, rows, row_mask, S, stride_shift, stride_scale, cols, mask,
                DTYPE: tl.constexpr):
    """``n * (1 + scale[i]) + shift[i]`` with eager's three roundings to ``DTYPE``; ``i = index[row % S]``."""
    seg = tl.load(index_ptr + rows % S, mask=row_mask, other=0).to(tl.int64)
    scale = to_f32(tl.load(scale_ptr + seg[:, None] * stride_scale + cols[None, :], mask=mask, other=0.0))
    shift = to_f32(tl.load(shift_ptr + seg[:, None] * stride_shift + cols[None, :], mask=mask, other=0.0))
    product = round_f32(n * round_f32(1.0 + scale, DTYPE), DTYPE)
    return round_f32(product + shift, DTYPE)


@fast_launch
@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr, w_ptr, shift_ptr, scale_ptr, index_ptr, y_ptr, rstd_ptr,
    M, H, S, stride_shift, stride_scale, eps, h_float,
    HAS_MOD: tl.constexpr, DTYPE: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # ROWS rows per program, each reduced on its own along axis 1: a row's bits never see its neighbours.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_H)
    row_mask = rows < M
    mask = row_mask[:, None] & (cols < H)[None, :]
    offs = rows[:, None] * H + cols[None, :]
    x = to_f32(tl.load(x_ptr + offs, mask=mask, other=0.0))
    w = to_f32(tl.load(w_ptr + cols, mask=cols < H, other=0.0))
    mean_square = tl.math.div_rn(tl.sum(x * x, axis=1), h_float)
    rstd = tl.math.div_rn(1.0, tl.sqrt_rn(mean_square + eps))
    # PyTorch's fused CPU RMSNorm keeps x * rstd in fp32 and rounds only after the weight multiply.
    y = round_f32((x * rstd[:, None]) * w[None, :], DTYPE)
    if HAS_MOD:
        y = _modulation(y, shift_ptr, scale_ptr, index_ptr, rows, row_mask, S, stride_shift, stride_scale, cols,
                        mask, DTYPE)
    tl.store(y_ptr + offs, from_f32(y, DTYPE), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)


@triton.jit
def _bwd_row_terms(x_ptr, dy_ptr, rstd_ptr, scale_ptr, index_ptr, rows, row_mask, cols, mask, offs, S,
                   stride_scale, HAS_MOD: tl.constexpr, DTYPE: tl.constexpr):
    """``(x_hat, g, rstd)`` of these rows: the normalized input ``x * rstd``, the gradient reaching the
    norm's weight product (``dy`` times the modulation's rounded ``1 + scale`` when modulated) and the
    rows' rstd."""
    x = to_f32(tl.load(x_ptr + offs, mask=mask, other=0.0))
    g = to_f32(tl.load(dy_ptr + offs, mask=mask, other=0.0))
    rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
    x_hat = x * rstd[:, None]
    if HAS_MOD:
        seg = tl.load(index_ptr + rows % S, mask=row_mask, other=0).to(tl.int64)
        scale = to_f32(tl.load(scale_ptr + seg[:, None] * stride_scale + cols[None, :], mask=mask, other=0.0))
        # dL/dnormed stays in fp32 here (eager rounds it to DTYPE): more accurate, same bits every run.
        g = g * round_f32(1.0 + scale, DTYPE)
    return x_hat, g, rstd


@fast_launch
@triton.jit
def _rms_norm_bwd_dx_kernel(
    x_ptr, w_ptr, dy_ptr, rstd_ptr, scale_ptr, index_ptr, dx_ptr, normed_ptr,
    M, H, S, stride_scale, h_float,
    HAS_MOD: tl.constexpr, DTYPE: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # ROWS rows per program, each reduced on its own along axis 1: a row's bits never see its neighbours.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_H)
    row_mask = rows < M
    mask = row_mask[:, None] & (cols < H)[None, :]
    offs = rows[:, None] * H + cols[None, :]
    w = to_f32(tl.load(w_ptr + cols, mask=cols < H, other=0.0))
    x_hat, g, rstd = _bwd_row_terms(x_ptr, dy_ptr, rstd_ptr, scale_ptr, index_ptr, rows, row_mask, cols, mask, offs,
                                    S, stride_scale, HAS_MOD, DTYPE)
    if HAS_MOD:
        # The stored normalized value multiplies g in d_scale, exactly as eager's product backward.
        tl.store(normed_ptr + offs, from_f32(round_f32(x_hat * w[None, :], DTYPE), DTYPE), mask=mask)
    u = g * w[None, :]
    c_row = tl.math.div_rn(tl.sum(u * x_hat, axis=1), h_float)
    dx = (u - x_hat * c_row[:, None]) * rstd[:, None]
    tl.store(dx_ptr + offs, from_f32(round_f32(dx, DTYPE), DTYPE), mask=mask)


@fast_launch
@triton.jit
def _rms_norm_bwd_dw_kernel(
    x_ptr, dy_ptr, rstd_ptr, scale_ptr, index_ptr, dw_partials_ptr,
    M, H, S, stride_scale, stride_partials,
    HAS_MOD: tl.constexpr, DTYPE: tl.constexpr, TILE_ROWS: tl.constexpr, SUB_ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    tile = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    dw = tl.zeros([BLOCK_C], dtype=tl.float32)
    # The tile's rows in ascending chunks of SUB_ROWS; each column's terms of a chunk meet in a fixed
    # tl.sum tree over the chunk's rows (SUB_ROWS = 1: one plain sum over the tile, row by row).
    for c in tl.static_range(TILE_ROWS // SUB_ROWS):
        rows = tile * TILE_ROWS + c * SUB_ROWS + tl.arange(0, SUB_ROWS)
        row_mask = rows < M
        mask = row_mask[:, None] & (cols < H)[None, :]
        x_hat, g, _ = _bwd_row_terms(x_ptr, dy_ptr, rstd_ptr, scale_ptr, index_ptr, rows, row_mask, cols, mask,
                                     rows[:, None] * H + cols[None, :], S, stride_scale, HAS_MOD, DTYPE)
        dw += tl.sum(g * x_hat, axis=0)
    tl.store(dw_partials_ptr + tile * stride_partials + cols, dw, mask=cols < H)


def _block_h(h: int) -> int:
    """The whole row in one block: the next power of two ``>= h`` (``triton.next_power_of_2``, without
    its constexpr-call overhead on the host)."""
    return 1 << max(h - 1, 0).bit_length()


def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float, shift: torch.Tensor | None = None,
                 scale: torch.Tensor | None = None, index: torch.Tensor | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y like x, rstd (M,) fp32)`` for contiguous ``x`` viewed as ``(M, H)``; modulated when
    ``shift``/``scale`` (``(R, H)``, unit column stride) and ``index`` ``(S,)`` are
    given, row ``m`` using ``index[m % S]``. Trusted: inputs are not validated."""
    h = x.shape[-1]
    m = x.numel() // h if h else 0
    y = torch.empty_like(x)
    # An int size, not a tuple: the same tensor with less argument parsing.
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    if m == 0 or h == 0:
        return y, rstd.zero_()
    has_mod = shift is not None
    rows, kwargs = _fwd_args(x.dtype, x.device, h, has_mod)
    if has_mod:
        _rms_norm_fwd_kernel[(-(-m // rows),)](x, weight, shift, scale, index, y, rstd, m, h, index.shape[0],
                                                 shift.stride(0), scale.stride(0), eps, float(h), **kwargs)
    else:
        _rms_norm_fwd_kernel[(-(-m // rows),)](x, weight, x, x, rstd, y, rstd, m, h, 1, 0, 0, eps, float(h), **kwargs)
    return y, rstd


@functools.cache
def _fwd_args(dtype: torch.dtype, device: torch.device, h: int, has_mod: bool) -> tuple[int, dict]:
    """``(ROWS, the forward's keyword arguments)``: the frozen config and the block width, read once
    per (dtype, device, H, modulated) rather than on every call."""
    cfg = config_on("rms_norm_fwd", dtype, device)
    # Eager rounds the modulation's product before the add: no fused multiply-add.
    return cfg["ROWS"], dict(HAS_MOD=has_mod, DTYPE=_TL_DTYPE[dtype], ROWS=cfg["ROWS"], BLOCK_H=_block_h(h),
                             num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False)


def rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                 shift: torch.Tensor | None = None, scale: torch.Tensor | None = None,
                 index: torch.Tensor | None = None, config: LaunchConfig | None = None,
                 segment_config: LaunchConfig | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(dx like x, dweight (H,) fp32, dshift, dscale (R, H) fp32 or None)``; dweight and the table
    gradients are fixed-order sums over 64-row tiles. Trusted: inputs are not validated. ``config``
    and ``segment_config``: a benchmark's or test's override of the frozen ``rms_norm_bwd`` config and
    of the ``segment_sum_partials`` one the table gradients' partials launch with.

    With modulation the three gradients share one ``(tiles, H + 2 R H)`` fp32 partial buffer,
    ``[dweight | dshift | dscale]`` per tile: the norm kernel writes the dweight columns, one
    segment-sum launch the table columns, and one fold reduces all of them. The fold sums each
    column on its own in the same order at any width, so the bits equal three separate folds.
    """
    dx, folded = _rms_norm_bwd(dy, x, weight, rstd, shift, scale, index, config, segment_config)
    if shift is None:
        return dx, folded, None, None
    return (dx, *_unpack(folded, x.shape[-1], shift.shape[0]))


def _rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                  shift: torch.Tensor | None, scale: torch.Tensor | None, index: torch.Tensor | None,
                  config: LaunchConfig | None = None, segment_config: LaunchConfig | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, folded fp32 gradients)``: ``(H,)`` without modulation, else ``(H + 2 R H,)`` packed."""
    h = x.shape[-1]
    m = x.numel() // h if h else 0
    dy = dy.contiguous()
    cfg = config or config_for("rms_norm_bwd", x)
    tiles = max(-(-m // cfg["TILE_ROWS"]), 1)
    dx = torch.empty_like(x)
    has_mod = shift is not None
    r = shift.shape[0] if has_mod else 0
    partials = torch.empty((tiles, h + 2 * r * h), dtype=torch.float32, device=x.device)
    # Without modulation the kernels never touch ``normed``, ``scale`` or ``index``; valid pointers stand in.
    normed = torch.empty((m, h), dtype=x.dtype, device=x.device) if has_mod else dx
    mod = (scale, index, index.shape[0], scale.stride(0)) if has_mod else (x, rstd, 1, 0)
    if h > 0:
        dx_rows = cfg["DX_ROWS"]
        _rms_norm_bwd_dx_kernel[(-(-m // dx_rows),)](
            x, weight, dy, rstd, mod[0], mod[1], dx, normed, m, h, mod[2], mod[3], float(h),
            HAS_MOD=has_mod, DTYPE=_TL_DTYPE[x.dtype], ROWS=dx_rows, BLOCK_H=_block_h(h),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        _rms_norm_bwd_dw_kernel[(tiles, -(-h // cfg["BLOCK_C"]))](
            x, dy, rstd, mod[0], mod[1], partials, m, h, mod[2], mod[3], partials.stride(0),
            HAS_MOD=has_mod, DTYPE=_TL_DTYPE[x.dtype], TILE_ROWS=cfg["TILE_ROWS"], SUB_ROWS=cfg["SUB_ROWS"],
            BLOCK_C=cfg["BLOCK_C"], num_warps=cfg["DW_WARPS"])
    if has_mod:
        rows = dy.reshape(m, h)
        if num_tiles(rows) != tiles:
            raise RuntimeError("rms_norm_bwd and segment_sum_partials configs disagree on the tile rows")
        write_segment_partials(partials[:, h:], rows, index, r, other=normed, period=index.shape[0], pair=True,
                               config=segment_config)
    return dx, fold_partials(partials)


def _rms_norm_fwd_pair(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, rstd)`` as one opaque op, so torch.compile and CUDA graphs replay the same launch."""
    return rms_norm_fwd(x, weight, eps)


_rms_norm_fwd_op = kernel_op("flowlock::rms_norm_fwd", _rms_norm_fwd_pair)


@_rms_norm_fwd_op.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape), x.new_empty((x.numel() // max(x.shape[-1], 1),), dtype=torch.float32)


def _rms_norm_bwd_pair(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dweight in weight.dtype)``."""
    dx, dweight, _, _ = rms_norm_bwd(dy, x, weight, rstd)
    return dx, dweight.to(weight.dtype)


_rms_norm_bwd_op = kernel_op("flowlock::rms_norm_bwd", _rms_norm_bwd_pair)


@_rms_norm_bwd_op.register_fake
def _(dy, x, weight, rstd):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _rms_norm_modulate_fwd_pair(x: torch.Tensor, weight: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
                                index: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, rstd)`` of the modulated norm as one opaque op."""
    return rms_norm_fwd(x, weight, eps, shift, scale, index)


_rms_norm_modulate_fwd_op = kernel_op("flowlock::rms_norm_modulate_fwd", _rms_norm_modulate_fwd_pair)


@_rms_norm_modulate_fwd_op.register_fake
def _(x, weight, shift, scale, index, eps):
    return x.new_empty(x.shape), x.new_empty((x.numel() // max(x.shape[-1], 1),), dtype=torch.float32)


def _rms_norm_modulate_bwd_packed(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                                  shift: torch.Tensor, scale: torch.Tensor, index: torch.Tensor
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, [dweight | dshift | dscale] (H + 2 R H,) fp32)``: the folded gradients in one buffer, so
    the custom op returns no aliasing views; :func:`_unpack` splits them."""
    return _rms_norm_bwd(dy, x, weight, rstd, shift, scale, index)


_rms_norm_modulate_bwd_op = kernel_op("flowlock::rms_norm_modulate_bwd", _rms_norm_modulate_bwd_packed)


@_rms_norm_modulate_bwd_op.register_fake
def _(dy, x, weight, rstd, shift, scale, index):
    h = x.shape[-1]
    return x.new_empty(x.shape), x.new_empty((h + 2 * shift.shape[0] * h,), dtype=torch.float32)


def _unpack(folded: torch.Tensor, h: int, r: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dweight (H,), dshift (R, H), dscale (R, H))`` views of the packed fp32 gradients."""
    return folded[:h], folded[h:h + r * h].view(r, h), folded[h + r * h:].view(r, h)


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, rstd)`` as every path runs it: the registered custom op while tracing, else the launcher."""
    return (_rms_norm_fwd_op if traced() else rms_norm_fwd)(x, weight, eps)


def rms_norm_modulate_forward(x: torch.Tensor, weight: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
                              index: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, rstd)`` of the modulated norm, through the custom op only while tracing."""
    if traced():
        return _rms_norm_modulate_fwd_op(x, weight, shift, scale, index, eps)
    return rms_norm_fwd(x, weight, eps, shift, scale, index)


class RMSNormFunction(torch.autograd.Function):
    """Autograd boundary of the plain norm: ``(x, weight, eps) -> y``."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = rms_norm_forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dweight = (_rms_norm_bwd_op if traced() else _rms_norm_bwd_pair)(dy, x, weight, rstd)
        return dx, dweight, None


class RMSNormModulateFunction(torch.autograd.Function):
    """Autograd boundary of the modulated norm: ``(x, weight, shift, scale, index, eps) -> y``."""

    @staticmethod
    def forward(ctx, x, weight, shift, scale, index, eps):
        y, rstd = rms_norm_modulate_forward(x, weight, shift, scale, index, eps)
        ctx.save_for_backward(x, weight, rstd, shift, scale, index)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd, shift, scale, index = ctx.saved_tensors
        bwd = _rms_norm_modulate_bwd_op if traced() else _rms_norm_modulate_bwd_packed
        dx, folded = bwd(dy, x, weight, rstd, shift, scale, index)
        dweight, dshift, dscale = _unpack(folded, x.shape[-1], shift.shape[0])
        # Each parameter gradient rounded once to its tensor's dtype (a no-op for fp32).
        return dx, dweight.to(weight.dtype), dshift.to(shift.dtype), dscale.to(scale.dtype), None, None
