"""Sigma grids: bitwise equal to the real diffusers scheduler, explicit step-count convention."""

import pytest
import torch
from diffusers import MiniMaxH3Scheduler

from flowlock.rl.schedules import sigma_grid, timesteps_from_sigmas
from flowlock.testing import assert_bitwise_equal


@pytest.mark.parametrize("shift", [12.0, 3.0])
def test_grid_points_bitwise_equal_to_diffusers(shift):
    scheduler = MiniMaxH3Scheduler(shift=shift)
    for n in range(2, 101):
        scheduler.set_timesteps(n)
        grid = sigma_grid(n, shift, convention="grid_points")
        assert_bitwise_equal(grid, scheduler.sigmas, f"sigmas n={n}")
        assert_bitwise_equal(timesteps_from_sigmas(grid), scheduler.timesteps, f"timesteps n={n}")
        assert grid.dtype == torch.float32 and grid.device.type == "cpu"


@pytest.mark.parametrize("shift", [12.0, 3.0])
def test_evaluations_convention_has_one_more_point(shift):
    scheduler = MiniMaxH3Scheduler(shift=shift)
    for n in range(1, 100):
        scheduler.set_timesteps(n + 1)
        grid = sigma_grid(n, shift, convention="evaluations")
        assert_bitwise_equal(grid, scheduler.sigmas, f"n={n}")
        assert grid.numel() - 1 == n


def test_collapsed_duplicates_are_counted_not_assumed():
    # An extreme shift maps several grid points near sigma = 1 onto one float32.
    grid = sigma_grid(400, 1e5, convention="grid_points")
    assert grid.numel() == 295
    assert bool((grid[1:] < grid[:-1]).all())


def test_non_monotone_grid_is_rejected():
    with pytest.raises(ValueError, match="not strictly decreasing"):
        sigma_grid(200, 1e5, convention="grid_points")


@pytest.mark.parametrize("kwargs, error", [
    (dict(num_steps=1, shift=12.0, convention="grid_points"), ValueError),
    (dict(num_steps=0, shift=12.0, convention="evaluations"), ValueError),
    (dict(num_steps=10, shift=12.0, convention="points"), ValueError),
    (dict(num_steps=10.0, shift=12.0, convention="grid_points"), TypeError),
    (dict(num_steps=10, shift=0.0, convention="grid_points"), ValueError),
    (dict(num_steps=10, shift=float("nan"), convention="grid_points"), ValueError),
])
def test_bad_arguments_raise(kwargs, error):
    with pytest.raises(error):
        sigma_grid(**kwargs)


def test_convention_is_required():
    with pytest.raises(TypeError):
        sigma_grid(10, 12.0)
