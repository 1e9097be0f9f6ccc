"""Triton segment_sum: per-tile partial sums, then a fixed multi-level fold over the tiles.

Layout contract shared with consumers that write partials themselves: rows are cut into tiles of
:func:`tile_rows` (64) consecutive rows; tile ``t`` writes ``partials[t, r, :]``, the sum of its rows
whose segment is ``r`` (zero when it has none), for every ``r``; the tiles are then folded in fp32 by
:func:`~flowlock.ops.segment_sum.fold.fold_partials` (ascending groups of a frozen size, level by level).
Neither step depends on anything but the row count, so the result is repeatable, and never uses atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flowlock.config import LaunchConfig, config_for, launch_config
from flowlock.ops._fp_bits import to_f32
from flowlock.ops._launch import fast_launch
from flowlock.ops.segment_sum.fold import fold_partials


@triton.jit
def only_segment(segment, R, ONE_SEGMENT: tl.constexpr):
    """The segment every row of the tile has (``segment`` is -1 on rows past the end), or -1 when
    they have several or ONE_SEGMENT is off."""
    if ONE_SEGMENT:
        lo = tl.min(tl.where(segment >= 0, segment, R), axis=0)
        return tl.where(lo == tl.max(segment, axis=0), lo, -1)
    else:
        return -1


@triton.jit
def segment_partials(v, segment, only, out, R, N, col_mask):
    """Store the tile's per-segment column sums of ``v`` at ``out + r * N`` for every ``r < R``;
    ``v`` is +0.0 on rows past the end (every caller loads with ``other=0.0``).

    Shared by every kernel that writes segment partials, so they all reduce with the same code.
    ``only`` (:func:`only_segment`): when every row has that one segment (most tiles: H3's text,
    video and audio rows are runs of hundreds), ``v`` is element for element the operand that
    segment's sum reduces (rows past the end included), so its one ``tl.sum`` tree gives the same
    bits, and the others are stored as the +0.0 a sum of exact zeros is: one tree in place of R.
    """
    if only >= 0:
        part = tl.sum(v, axis=0)
        for r in range(R):
            tl.store(out + r * N, tl.where(r == only, part, 0.0), mask=col_mask)
    else:
        for r in range(R):
            # A fixed tl.sum tree over the tile's rows; rows of other segments contribute exact zeros.
            part = tl.sum(tl.where(segment[:, None] == r, v, 0.0), axis=0)
            tl.store(out + r * N, part, mask=col_mask)


@fast_launch
@triton.jit
def _segment_sum_partials_kernel(
    values_ptr, other_ptr, index_ptr, partials_ptr,
    M, N, R, period, stride_values, stride_other, stride_tile,
    HAS_OTHER: tl.constexpr, PAIR: tl.constexpr, ONE_SEGMENT: tl.constexpr, TILE_ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    tile = tl.program_id(0)
    rows = tile.to(tl.int64) * TILE_ROWS + tl.arange(0, TILE_ROWS)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    mask = row_mask[:, None] & col_mask[None, :]
    segment = tl.load(index_ptr + rows % period, mask=row_mask, other=-1)
    only = only_segment(segment, R, ONE_SEGMENT)
    v = to_f32(tl.load(values_ptr + rows[:, None] * stride_values + cols[None, :], mask=mask, other=0.0))
    out = partials_ptr + tile.to(tl.int64) * stride_tile + cols
    if PAIR:
        # The plain sums first, then (R * N further on) the sums of the products: one read of the tile.
        segment_partials(v, segment, only, out, R, N, col_mask)
        out = out + R * N
    if HAS_OTHER:
        # Products of bf16/fp16 factors are exact in fp32, so only the sums round.
        v = v * to_f32(tl.load(other_ptr + rows[:, None] * stride_other + cols[None, :], mask=mask, other=0.0))
    segment_partials(v, segment, only, out, R, N, col_mask)


def tile_rows(dtype: torch.dtype, arch: str) -> int:
    """Rows per partial tile (the layout contract): 64 for every dtype and architecture."""
    return launch_config("segment_sum_partials", dtype, arch)["TILE_ROWS"]


def num_tiles(values: torch.Tensor) -> int:
    """Partial tiles (at least one) over the rows of ``(M, N)`` ``values``."""
    return max(-(-values.shape[0] // config_for("segment_sum_partials", values)["TILE_ROWS"]), 1)


def write_segment_partials(partials: torch.Tensor, values: torch.Tensor, index: torch.Tensor, num_segments: int, *,
                           other: torch.Tensor | None = None, period: int | None = None, pair: bool = False,
                           config: LaunchConfig | None = None) -> None:
    """Write the per-tile segment sums of ``values`` (times ``other`` if given) into ``partials``.

    ``partials``: fp32 ``(num_tiles(values), W)`` with unit column stride (a column slice of a wider
    buffer qualifies, so several reductions over the same tiles share one fold); tile ``t`` writes
    ``partials[t, r * N + n]``. With ``pair=True`` (``other`` required) one launch writes the plain
    sums to columns ``[0, R * N)`` and the sums of the products to ``[R * N, 2 * R * N)``, each the
    same bits as its own launch. Row ``m`` belongs to segment ``index[m % period]`` (``period``
    defaults to ``M``). ``config``: a test's or benchmark's override of the frozen config (its
    TILE_ROWS must be the frozen one). Trusted: inputs are not validated.
    """
    m, n = values.shape
    if n == 0 or num_segments == 0:
        return
    cfg = config or config_for("segment_sum_partials", values)
    o = values if other is None else other
    _segment_sum_partials_kernel[(max(-(-m // cfg["TILE_ROWS"]), 1), -(-n // cfg["BLOCK_N"]))](
        values, o, index, partials, m, n, num_segments, max(m if period is None else period, 1), values.stride(0),
        o.stride(0), partials.stride(0),
        HAS_OTHER=other is not None, PAIR=pair, ONE_SEGMENT=bool(cfg["ONE_SEGMENT"]), TILE_ROWS=cfg["TILE_ROWS"],
        BLOCK_N=cfg["BLOCK_N"],
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def segment_sum_partials(values: torch.Tensor, index: torch.Tensor, num_segments: int, *,
                         other: torch.Tensor | None = None, period: int | None = None) -> torch.Tensor:
    """Per-tile segment sums ``(num_tiles, R, N)`` fp32 of ``values`` (times ``other`` if given).

    ``values`` and ``other``: ``(M, N)`` with unit column stride, same dtype. Row ``m`` belongs to
    segment ``index[m % period]`` (``period`` defaults to ``M``; pass ``S`` for ``(B*S, N)`` rows
    sharing one ``(S,)`` index). Trusted: inputs are not validated.
    """
    partials = torch.empty((num_tiles(values), num_segments, values.shape[1]), dtype=torch.float32,
                           device=values.device)
    write_segment_partials(partials, values, index, num_segments, other=other, period=period)
    return partials


def segment_sum_fold(partials: torch.Tensor) -> torch.Tensor:
    """Fold ``(num_tiles, R, N)`` fp32 partials (``num_tiles >= 1``) into ``(R, N)`` fp32 with
    :func:`fold_partials`, the shared fixed-order multi-level fold."""
    return fold_partials(partials)


def segment_sum_fwd(values: torch.Tensor, index: torch.Tensor, num_segments: int, *,
                    other: torch.Tensor | None = None, period: int | None = None) -> torch.Tensor:
    """``(R, N)`` fp32 segment sums: :func:`segment_sum_partials` then :func:`segment_sum_fold`."""
    return segment_sum_fold(segment_sum_partials(values, index, num_segments, other=other, period=period))
