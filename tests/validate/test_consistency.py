"""The rollout/replay consistency run: reports numbers, and sees a planted batch-dependent model."""

import json

import pytest
import torch

from flowlock.models.minimax_h3 import tiny_h3
from flowlock.validate.consistency import run_consistency


@pytest.fixture(scope="module")
def model():
    return tiny_h3(seed=0)


class BatchDependent(torch.nn.Module):
    """Wraps the H3 model and nudges its video velocity by an amount that depends on the batch size."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.config = inner.config

    def forward(self, **kwargs):
        video, audio = self.inner(**kwargs)
        return video + 1e-3 * video.shape[0], audio


def test_provider_run_reports_per_step_numbers(model):
    report = run_consistency(model, n_samples=4, steps=3, eta=0.8, seed=1, rollout_batch=4,
                             replay_micro_batch=3, replay_order="shuffled", mode="provider")
    json.dumps(report)
    assert report["transitions"] == 3 and len(report["per_step"]) == 3
    for step in report["per_step"]:
        assert step["velocity_elements"] == 4 * (12 * 16 + 7 * 8)
        assert step["max_abs_dlogp"] >= 0 and step["ratio_spread"] >= 0
        assert 0 <= step["logp_mismatches"] <= 4
    assert len(report["first_difference"]) == 4
    assert report["bitwise_equal"] == (report["max_abs_dlogp"] == 0 and all(
        s["velocity_mismatches"] == 0 for s in report["per_step"]))


def test_run_catches_a_batch_dependent_model(model):
    report = run_consistency(BatchDependent(model), n_samples=4, steps=2, eta=0.8, seed=0,
                             replay_micro_batch=1, mode="provider")
    assert not report["bitwise_equal"]
    first = report["per_step"][0]
    assert first["max_abs_dlogp"] > 0 and first["logp_mismatches"] == 4 and first["ratio_spread"] > 0
    assert first["velocity_mismatches"] == 4 * 12 * 16  # every video element, no audio element
    for diff in report["first_difference"]:
        assert diff["step"] == 0 and diff["name"] in ("log_prob", "velocity.video")


def test_same_composition_replay_is_bitwise(model):
    report = run_consistency(model, n_samples=2, steps=2, seed=3, rollout_batch=2, replay_micro_batch=2,
                             replay_order="same", mode="provider")
    assert report["bitwise_equal"] and report["first_difference"] == [None, None]


def test_strict_mode_replays_bitwise_and_unpatches(model):
    forward = model.forward
    report = run_consistency(model, n_samples=2, steps=1, rollout_batch=2, replay_micro_batch=1, mode="strict")
    assert report["bitwise_equal"], report
    assert model.forward == forward


@pytest.mark.parametrize("kwargs", [
    dict(mode="audit"), dict(mode="provider", replay_order="random"), dict(mode="provider", n_samples=0),
    dict(mode="provider", rollout_batch=0), dict(mode="provider", steps=1.5),
])
def test_bad_arguments(model, kwargs):
    with pytest.raises(ValueError):
        run_consistency(model, **kwargs)
