"""H3's schedules: video shift 12 and audio shift 3 on the generic grid, transition counts that agree."""

import pytest

from flowlock.rl.minimax_h3 import h3_schedules
from flowlock.rl.schedules import sigma_grid
from flowlock.testing import assert_bitwise_equal


def test_h3_schedules_defaults_and_transition_count():
    sched = h3_schedules(10, convention="grid_points")
    assert_bitwise_equal(sched.video_sigmas, sigma_grid(10, 12.0, convention="grid_points"))
    assert_bitwise_equal(sched.audio_sigmas, sigma_grid(10, 3.0, convention="grid_points"))
    assert sched.num_transitions == 9
    assert h3_schedules(10, convention="evaluations").num_transitions == 10
    assert sched.video_sigmas[0] == 1.0 and sched.video_sigmas[-1] == 0.0


def test_grids_collapsed_to_different_lengths_are_refused():
    # An extreme video shift collapses grid points near sigma = 1 that the audio grid keeps.
    with pytest.raises(ValueError, match="transition counts must agree"):
        h3_schedules(400, convention="grid_points", video_shift=1e5)


def test_convention_is_required():
    with pytest.raises(TypeError):
        h3_schedules(10)
