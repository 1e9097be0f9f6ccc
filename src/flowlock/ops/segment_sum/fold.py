"""Multi-level fold of per-tile fp32 partials: the one cross-program reduction that table, weight and
norm gradients share (segment_sum, rms_norm's dweight, qk_norm_rope's dweight).

Order (it depends on the tile count and the frozen ``GROUP`` of :func:`fold_group` only, never on the
GPU): a level cuts the ``T`` rows of partials into groups of ``GROUP`` consecutive rows and sums each
group in ascending row order, starting from its first row (``acc = p[g*GROUP]``, then ``acc += p[i]``),
giving ``ceil(T / GROUP)`` rows; levels repeat until one row is left, and at least one level always runs.
Every group of every level is its own program, so a level over ``T`` rows runs ``ceil(T / GROUP)`` programs
in parallel instead of one program walking all ``T`` rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flowlock.config import config_for, launch_config
from flowlock.ops._launch import fast_launch


@fast_launch
@triton.jit
def _fold_groups_kernel(src_ptr, dst_ptr, T, L, GROUP: tl.constexpr, BLOCK: tl.constexpr):
    # Column blocks on axis 0 (limit 2^31 - 1), groups on axis 1 (limit 65535 = 65535 * GROUP tiles).
    group = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < L
    first = group * GROUP
    ptrs = src_ptr + first * L + offs
    acc = tl.load(ptrs, mask=mask, other=0.0)
    for _ in range(1, tl.minimum(T - first, GROUP)):
        # Advance the pointer rather than forming i * L, which can pass 2^31 in int32.
        ptrs += L
        acc += tl.load(ptrs, mask=mask, other=0.0)
    tl.store(dst_ptr + group * L + offs, acc, mask=mask)


def fold_group(arch: str) -> int:
    """Rows summed per program per level (part of the reduction order): a frozen per-arch constant."""
    return launch_config("fold_partials", torch.float32, arch)["GROUP"]


def fold_partials(partials: torch.Tensor) -> torch.Tensor:
    """Fold ``(T, ...)`` contiguous fp32 partials (``T >= 1``) over dim 0 into ``(...)`` fp32.

    Typical shapes: ``(tiles, R, N)`` -> ``(R, N)`` or ``(tiles, N)`` -> ``(N,)``. Bits depend only on the
    values, ``T`` and the frozen group size (see the module docstring); no atomics. Trusted: not validated.
    """
    t = partials.shape[0]
    tail = partials.shape[1:]
    cfg = config_for("fold_partials", partials, dtype=torch.float32)
    group, block = cfg["GROUP"], cfg["BLOCK"]
    src = partials.reshape(t, -1)
    width = src.shape[1]
    if width == 0:
        return torch.empty(tail, dtype=torch.float32, device=partials.device)
    col_blocks = -(-width // block)
    while True:
        groups = -(-t // group)
        dst = torch.empty((groups, width), dtype=torch.float32, device=partials.device)
        _fold_groups_kernel[(col_blocks, groups)](
            src, dst, t, width, GROUP=group, BLOCK=block, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        src, t = dst, groups
        if t == 1:
            return src.reshape(tail)
