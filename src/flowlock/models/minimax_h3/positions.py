"""The range of ``position_ids`` the strict H3 path accepts: finite, in ``[0, 2**24]``.

RoPE casts positions to float32 and multiplies them by ``inv_freq`` (``rope_cos_sin``): float32
holds every integer up to 2**24 exactly and no longer all above it (two positions would share one
angle). The model makes no negative positions: text rows sit at 0, video and audio rows count up
from 0 along each axis (:func:`flowlock.models.minimax_h3.packing.build_packing`, as diffusers lays out
H3's packed sequence), so a negative one is a caller's bug.
"""

from __future__ import annotations

import torch

from flowlock.ops._validate import memoized_over

# float32 holds every integer up to 2**24 exactly; RoPE computes position * inv_freq in float32.
MAX_POSITION = 2 ** 24


def check_positions(position_ids: torch.Tensor, eager: bool) -> None:
    """``position_ids`` finite in ``[0, MAX_POSITION]`` (a memoized host read eagerly, an in-graph
    assert under ``torch.compile``); ValueError / RuntimeError naming it and the bound's reason."""
    message = (f"position_ids must lie in [0, {MAX_POSITION}]: RoPE multiplies them by inv_freq in float32, "
               "which holds integers exactly only up to 2**24, and the model makes no negative positions")
    if not position_ids.numel():
        return
    if not eager:
        torch._assert_async((torch.isfinite(position_ids) & (position_ids >= 0)
                             & (position_ids <= MAX_POSITION)).all(), message)
        return
    first = memoized_over([position_ids], "position_range", lambda: _first_outside(position_ids))
    if first is not None:
        raise ValueError(f"{message}; found {first}")


def _first_outside(position_ids: torch.Tensor):
    bad = ~torch.isfinite(position_ids) | (position_ids < 0) | (position_ids > MAX_POSITION)
    return position_ids[bad][0].item() if bool(bad.any()) else None
