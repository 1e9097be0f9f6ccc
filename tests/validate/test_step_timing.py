"""The RL-step timing: warm-up rounds stay out of the figures, medians of the timed rounds, the two
paths alternate which goes first, the ratio compares the medians, and bad arguments fail first."""

import pytest

import flowlock
import flowlock.modes
from flowlock.models.minimax_h3 import tiny_h3
from flowlock.validate import step_timing
from flowlock.validate.step_timing import time_rl_step


@pytest.fixture(scope="module")
def model():
    return tiny_h3(seed=0)


class Ticking:
    """A forward pre-hook on the H3 model advancing a fake clock per forward: the very first by 100 (a
    compile), later ones by 2 under strict and 1 under stock, plus ``extra`` (set by a test)."""

    def __init__(self, model):
        self.now, self.extra, self.calls = 0.0, 0.0, []
        self.handle = model.register_forward_pre_hook(self)

    def __call__(self, module, args):
        mode = flowlock.modes.current_mode()
        self.calls.append(mode)
        self.now += 100.0 if len(self.calls) == 1 else (2.0 if mode == "strict" else 1.0) + self.extra


@pytest.fixture
def ticking(model, monkeypatch):
    tick = Ticking(model)
    monkeypatch.setattr(step_timing, "_clock", lambda device: tick.now)
    yield tick
    tick.handle.remove()


def test_warm_up_is_left_out_and_medians_compare_the_paths(model, ticking):
    report = time_rl_step(model, n_samples=2, replay_micro_batch=1, rounds=3, warmup=1)
    # one step = 1 rollout forward + 2 replay forwards: 6 s strict, 3 s stock; the 100 s first call is warm-up
    assert report["seconds"] == {"strict": [6.0, 6.0, 6.0], "provider": [3.0, 3.0, 3.0]}
    assert report["median_s"] == {"strict": 6.0, "provider": 3.0} and report["ratio"] == 2.0
    assert report["order"] == ["strict", "provider", "strict"]
    per_round = 2 * 3
    firsts = [ticking.calls[i] for i in range(per_round, len(ticking.calls), per_round)]
    assert firsts == ["strict", "provider", "strict"]  # timed rounds alternate which path runs first


def test_the_median_ignores_one_slow_round(model, ticking, monkeypatch):
    original = step_timing._timed

    def slow_second_round(model_, mode, step):
        ticking.extra = 10.0 if len(ticking.calls) == 2 * 2 * 3 else 0.0  # the second timed round's first path
        return original(model_, mode, step)

    monkeypatch.setattr(step_timing, "_timed", slow_second_round)
    report = time_rl_step(model, n_samples=2, replay_micro_batch=1, rounds=3, warmup=1)
    assert report["seconds"]["provider"] == [3.0, 33.0, 3.0]
    assert report["median_s"]["provider"] == 3.0


def test_strict_is_unpatched_after_timing(model):
    forward = model.forward
    report = time_rl_step(model, n_samples=1, rounds=1, warmup=0)
    assert model.forward == forward
    assert len(report["seconds"]["strict"]) == len(report["seconds"]["provider"]) == 1


@pytest.mark.parametrize("kwargs", [dict(n_samples=0), dict(replay_micro_batch=0), dict(rounds=0), dict(warmup=-1),
                                    dict(rounds=True), dict(n_samples=1.5)])
def test_bad_arguments_name_themselves(model, kwargs):
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=name):
        time_rl_step(model, **kwargs)
