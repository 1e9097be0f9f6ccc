"""The ``(3T, 6H)`` FP32 table gradient of ``adaln_modulation``: six row-gradient segment sums in one
partials launch and one fold.

Each chunk's column sums follow segment_sum's layout contract exactly: rows cut into the fixed
``TILE_ROWS`` tiles of its ``segment_sum_partials`` config, each tile reduced per table row by the same
``tl.sum`` tree over a ``(TILE_ROWS, BLOCK_N)`` block with the same warps, then the tiles folded by the
shared :func:`~flowlock.ops.segment_sum.fold.fold_partials`. The six chunks only share the launch and
the partial buffer ``(tiles, 3T, 6H)``: a column's fold order depends on the tile count alone, so one
fold over all six chunks gives each column the bits of its own per-chunk segment sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flowlock.config import config_for
from flowlock.ops._fp_bits import to_f32
from flowlock.ops._launch import fast_launch
from flowlock.ops._triton_utils import cdiv
from flowlock.ops.segment_sum.fold import fold_partials


@triton.jit
def _chunk_partials(g_ptr, segment, rows, row_mask, cols, col_mask, out, R, N, stride_g, stride_r,
                    PRESENT: tl.constexpr, BLOCK_N: tl.constexpr):
    if PRESENT:
        mask = row_mask[:, None] & col_mask[None, :]
        v = to_f32(tl.load(g_ptr + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0))
        for r in range(R):
            # A fixed tl.sum tree over the tile's rows; rows of other segments contribute exact zeros.
            part = tl.sum(tl.where(segment[:, None] == r, v, 0.0), axis=0)
            tl.store(out + r * stride_r, part, mask=col_mask)
    else:
        # A missing gradient is zero: its partials are zeros, so its folded columns are +0.0.
        for r in range(R):
            tl.store(out + r * stride_r, tl.zeros((BLOCK_N,), dtype=tl.float32), mask=col_mask)


@fast_launch
@triton.jit
def _adaln_table_grad_partials_kernel(
    g0_ptr, g1_ptr, g2_ptr, g3_ptr, g4_ptr, g5_ptr, ti_ptr, tag_ptr, partials_ptr,
    M, N, R, stride_g,
    PRESENT: tl.constexpr, TILE_ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # One program: one row tile and column block of all six chunks; the indices are read once.
    tile = tl.program_id(0)
    rows = tile.to(tl.int64) * TILE_ROWS + tl.arange(0, TILE_ROWS)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    ti = tl.load(ti_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    tag = tl.load(tag_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    # Table row ti*3 + tag; -1 (no row) past the end, as segment_sum's masked index load.
    segment = tl.where(row_mask, ti * 3 + tag, -1)
    stride_r = 6 * N
    out = partials_ptr + tile.to(tl.int64) * R * stride_r + cols
    _chunk_partials(g0_ptr, segment, rows, row_mask, cols, col_mask, out, R, N, stride_g, stride_r,
                    (PRESENT >> 0) & 1, BLOCK_N)
    _chunk_partials(g1_ptr, segment, rows, row_mask, cols, col_mask, out + N, R, N, stride_g, stride_r,
                    (PRESENT >> 1) & 1, BLOCK_N)
    _chunk_partials(g2_ptr, segment, rows, row_mask, cols, col_mask, out + 2 * N, R, N, stride_g, stride_r,
                    (PRESENT >> 2) & 1, BLOCK_N)
    _chunk_partials(g3_ptr, segment, rows, row_mask, cols, col_mask, out + 3 * N, R, N, stride_g, stride_r,
                    (PRESENT >> 3) & 1, BLOCK_N)
    _chunk_partials(g4_ptr, segment, rows, row_mask, cols, col_mask, out + 4 * N, R, N, stride_g, stride_r,
                    (PRESENT >> 4) & 1, BLOCK_N)
    _chunk_partials(g5_ptr, segment, rows, row_mask, cols, col_mask, out + 5 * N, R, N, stride_g, stride_r,
                    (PRESENT >> 5) & 1, BLOCK_N)


def adaln_modulation_bwd(grads: tuple[torch.Tensor | None, ...], timestep_indices: torch.Tensor,
                         token_tags: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Six ``(S, H)`` gradients of one dtype (``H >= 1``; ``None``: zero, not all ``None``) -> the
    ``(num_rows, 6H)`` FP32 table gradient, ``out[r, c*H:(c+1)*H] = Σ_{s: ti[s]*3 + tag[s] = r} grads[c][s]``.

    Bitwise the per-chunk ``segment_sum_fwd(grads[c], ti*3 + tag, num_rows)`` placed side by side (see
    the module docstring), from one partials launch and one :func:`fold_partials`. Trusted: the
    indices are ``(S,)`` and in range, checked by the public op.
    """
    ref = next(g for g in grads if g is not None)
    s, h = ref.shape
    # The tile rule and the reduction tree are segment_sum's: same config entry, same block, same warps.
    cfg = config_for("segment_sum_partials", ref)
    tiles = max(cdiv(s, cfg["TILE_ROWS"]), 1)
    partials = torch.empty((tiles, num_rows, 6 * h), dtype=torch.float32, device=ref.device)
    gs = [ref if g is None else g.contiguous() for g in grads]
    mask = sum(1 << c for c, g in enumerate(grads) if g is not None)
    _adaln_table_grad_partials_kernel[(tiles, cdiv(h, cfg["BLOCK_N"]))](
        *gs, timestep_indices, token_tags, partials, s, h, num_rows, h,
        PRESENT=mask, TILE_ROWS=cfg["TILE_ROWS"], BLOCK_N=cfg["BLOCK_N"],
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return fold_partials(partials)
