"""The range of ``position_ids`` the strict H3 path accepts: finite, in ``[-2**24, 2**24]``.

RoPE casts positions to float32 and multiplies them by ``inv_freq`` (``rope_cos_sin``): float32
holds every integer of magnitude up to 2**24 exactly and no longer all above it (two positions
would share one angle). Positions may be negative and fractional: vLLM-Omni's packing of a request
with a keyframe condition (FL2VA) places rows at positions such as -3.5959 and 6.6667, and the
engine-invariance tests run such requests through both engines.
"""

from __future__ import annotations

import torch

from flowlock.ops._validate import memoized_over

# float32 holds every integer up to 2**24 exactly; RoPE computes position * inv_freq in float32.
MAX_POSITION = 2 ** 24


def check_positions(position_ids: torch.Tensor, eager: bool) -> None:
    """``position_ids`` finite in ``[-MAX_POSITION, MAX_POSITION]`` (a memoized host read eagerly, an
    in-graph assert under ``torch.compile``); ValueError / RuntimeError naming it and the bound's reason."""
    message = (f"position_ids must be finite and lie in [-{MAX_POSITION}, {MAX_POSITION}]: RoPE multiplies them "
               "by inv_freq in float32, which holds integers exactly only up to magnitude 2**24")
    if not position_ids.numel():
        return
    if not eager:
        torch._assert_async((position_ids.abs() <= MAX_POSITION).all(), message)
        return
    first = memoized_over([position_ids], "position_range", lambda: _first_outside(position_ids))
    if first is not None:
        raise ValueError(f"{message}; found {first}")


def _first_outside(position_ids: torch.Tensor):
    # NaN compares false, so a NaN or an infinite position fails this bound as well
    bad = ~(position_ids.abs() <= MAX_POSITION)
    return position_ids[bad][0].item() if bool(bad.any()) else None
