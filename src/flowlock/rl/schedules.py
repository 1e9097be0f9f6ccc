"""Shifted flow-matching sigma grids, built exactly as diffusers builds them (model-independent; a
family's shifts and per-modality grids live in its own module, H3's in :mod:`flowlock.rl.minimax_h3`).

The grid is ``linspace(1, 0, n)`` in float32 on the CPU, pushed through the exponential shift
``s*σ / (1 + (s - 1)*σ)`` and collapsed with ``unique_consecutive`` (the shift can map neighbouring
points near ``σ = 1`` onto one float32). How ``n`` relates to the requested step count changed
across versions, so the convention is an explicit argument and the number of transitions is always
``len(grid) - 1``, never derived from the request.
"""

from __future__ import annotations

import math

import torch

CONVENTIONS = ("grid_points", "evaluations")


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
    """Timesteps ``t = 1 - σ`` (float32, the H3 convention: t = 1 is clean) for every grid point that has a
    model evaluation."""
    return 1.0 - sigmas[:-1]
