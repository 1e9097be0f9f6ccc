"""MiniMax-H3 sigma grids, built exactly as diffusers builds them.

The grid is ``linspace(1, 0, n)`` in float32 on the CPU, pushed through the exponential shift
``s*σ / (1 + (s - 1)*σ)`` and collapsed with ``unique_consecutive`` (the shift can map neighbouring
points near ``σ = 1`` onto one float32). How ``n`` relates to the requested step count changed
across versions, so the convention is an explicit argument and the number of transitions is always
``len(grid) - 1``, never derived from the request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

CONVENTIONS = ("grid_points", "evaluations")
VIDEO_SHIFT = 12.0
AUDIO_SHIFT = 3.0


def _grid_size(num_steps: int, convention: str) -> int:
    if convention not in CONVENTIONS:
        raise ValueError(f"convention must be one of {CONVENTIONS}, got {convention!r}")
    if isinstance(num_steps, bool) or not isinstance(num_steps, int):
        raise TypeError(f"num_steps must be an int, got {type(num_steps).__name__}")
    smallest = 2 if convention == "grid_points" else 1
    if num_steps < smallest:
        raise ValueError(f"num_steps must be >= {smallest} for convention {convention!r}, got {num_steps}")
    return num_steps if convention == "grid_points" else num_steps + 1


def sigma_grid(num_steps: int, shift: float, *, convention: str) -> torch.Tensor:
    """The shifted sigma grid, float32 on the CPU, strictly decreasing from 1 to a terminal 0.

    ``convention="grid_points"``: diffusers ``MiniMaxH3Scheduler.set_timesteps(num_steps)`` —
    ``num_steps`` grid points including the terminal 0, so ``num_steps - 1`` model evaluations
    (bitwise equal to that scheduler's ``sigmas``). ``convention="evaluations"``: vLLM-Omni 0.30 —
    ``linspace(1, 0, num_steps + 1)``, so ``num_steps`` evaluations. Either way the number of
    transitions is ``len(grid) - 1`` (it can be smaller than requested after collapsing).
    Raises ``ValueError`` when the collapsed grid is not strictly decreasing (extreme shifts).
    """
    n = _grid_size(num_steps, convention)
    if isinstance(shift, bool) or not isinstance(shift, (int, float)) or not math.isfinite(shift) or shift <= 0:
        raise ValueError(f"shift must be a finite positive number, got {shift!r}")
    shift = float(shift)
    base = torch.linspace(1.0, 0.0, n, dtype=torch.float32)
    # Same expression and operand types as diffusers, so the float32 roundings match bit for bit.
    shifted = shift * base / (1 + (shift - 1) * base)
    grid = torch.unique_consecutive(shifted)
    # Extreme shifts make the float32 grid non-monotone near 1; such a schedule has no meaning.
    if not bool((grid[1:] < grid[:-1]).all()):
        raise ValueError(f"shift={shift} gives a float32 sigma grid that is not strictly decreasing")
    return grid


def timesteps_from_sigmas(sigmas: torch.Tensor) -> torch.Tensor:
    """H3 timesteps ``t = 1 - σ`` (float32) for every grid point that has a model evaluation."""
    return 1.0 - sigmas[:-1]


@dataclass(frozen=True)
class H3Schedules:
    """The two per-modality grids of one H3 request (float32, CPU) and their timesteps."""

    video_sigmas: torch.Tensor
    audio_sigmas: torch.Tensor
    convention: str

    @property
    def num_transitions(self) -> int:
        return int(self.video_sigmas.numel()) - 1

    @property
    def video_timesteps(self) -> torch.Tensor:
        return timesteps_from_sigmas(self.video_sigmas)

    @property
    def audio_timesteps(self) -> torch.Tensor:
        return timesteps_from_sigmas(self.audio_sigmas)


def h3_schedules(num_steps: int, *, convention: str, video_shift: float = VIDEO_SHIFT,
                 audio_shift: float = AUDIO_SHIFT) -> H3Schedules:
    """Video (shift 12) and audio (shift 3) grids of one request.

    Raises ``ValueError`` when collapsing left the two grids with different lengths: H3 steps both
    modalities in one forward per transition, so the transition counts must agree.
    """
    video = sigma_grid(num_steps, video_shift, convention=convention)
    audio = sigma_grid(num_steps, audio_shift, convention=convention)
    if video.numel() != audio.numel():
        raise ValueError(f"num_steps={num_steps}: the video grid has {video.numel()} points and the audio grid "
                         f"{audio.numel()} after collapsing duplicates; the transition counts must agree")
    return H3Schedules(video, audio, convention)
