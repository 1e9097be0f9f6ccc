"""Conditioning-chain replay on the tiny diffusers H3: flowlock's stages are repeatable and batch
invariant, the promised bitwise equalities with diffusers hold, and the harness catches planted
non-invariant and non-repeatable stages."""

import importlib
import itertools

import pytest
import torch

from flowlock.models.minimax_h3.tiny import tiny_h3
from flowlock.validate.chain import STAGES, chain_replay

gate_residual_module = importlib.import_module("flowlock.ops.gate_residual")  # the family, not the op
rms_norm_module = importlib.import_module("flowlock.ops.rms_norm")


@pytest.fixture(scope="module")
def model():
    return tiny_h3()


@pytest.fixture(scope="module")
def report(model):
    return chain_replay(model)


def _stage(report, path, name):
    return next(s for s in report[path]["stages"] if s["stage"] == name)


def test_flowlock_stages_repeatable_and_invariant(report):
    assert [s["stage"] for s in report["flowlock"]["stages"]] == list(STAGES)
    for stage in report["flowlock"]["stages"]:
        assert stage["repeat_equal"], stage
        assert stage["invariant"], stage
    assert report["ok"]


def test_flowlock_gradients_repeatable_and_input_gradient_invariant(report):
    grads = report["flowlock"]["grads"]
    assert {g["param"] for g in grads} >= {"transformer_blocks.0.adaln_proj.linear.weight",
                                           "time_embedder.linear_1.weight", "norm_out.linear.weight"}
    assert all(g["repeat_equal"] and g["max_mismatches"] == 0 for g in grads)
    assert report["flowlock"]["x_grad_repeat_equal"] and report["flowlock"]["x_grad_invariant"]


def test_promised_equalities_with_diffusers(report):
    """The sinusoid is bitwise diffusers; gate_residual is bitwise diffusers on the same inputs."""
    assert _stage(report, "flowlock", "timestep_sinusoid")["chained_vs_provider"]
    assert _stage(report, "flowlock", "gate_residual")["local_vs_provider"]
    drift = report["first_drifting_stage"]
    assert drift is None or drift in STAGES[1:]
    if drift is not None:
        assert not _stage(report, "flowlock", drift)["chained_vs_provider"]


def test_report_is_json_and_states_backends(report):
    import json

    json.dumps(report)
    assert report["device"] == "cpu"
    assert any(b.endswith(":reference") for b in report["backends"])
    assert {b.split(":")[0] for b in report["backends"]} >= {"timestep_sinusoid", "gate_residual"}


def test_planted_batch_dependence_is_caught(model, monkeypatch):
    real = gate_residual_module.gate_residual

    def batch_dependent(residual, gate, y, index, **kw):
        out = real(residual, gate, y, index, **kw)
        return out * (1.0 + 2.0 ** -6 * (residual.shape[0] - 1))

    monkeypatch.setattr(gate_residual_module, "gate_residual", batch_dependent)
    planted = chain_replay(model, repeats=2)
    assert not _stage(planted, "flowlock", "gate_residual")["invariant"]
    assert _stage(planted, "flowlock", "norm1_modulate")["invariant"]
    assert not planted["flowlock"]["x_grad_invariant"]
    assert not planted["ok"]


def test_planted_non_repeatable_stage_is_caught(model, monkeypatch):
    real = rms_norm_module.rms_norm_modulate
    counter = itertools.count()

    def drifting(x, *args, **kw):
        out = real(x, *args, **kw)
        return out + (next(counter) % 2) * torch.finfo(torch.bfloat16).eps * out.detach().abs()

    monkeypatch.setattr(rms_norm_module, "rms_norm_modulate", drifting)
    planted = chain_replay(model, repeats=3, backward=False)
    assert not _stage(planted, "flowlock", "norm1_modulate")["repeat_equal"]
    assert _stage(planted, "flowlock", "adaln_modulation")["repeat_equal"]
    assert not planted["ok"]


def test_bad_arguments(model):
    with pytest.raises(ValueError, match="batch"):
        chain_replay(model, batch=1)
    with pytest.raises(ValueError, match="position"):
        chain_replay(model, batch=2, position=2)
    with pytest.raises(ValueError, match="repeats"):
        chain_replay(model, repeats=1)


def test_triton_kernels_under_interpreter_repeatable_and_invariant(model):
    """The same chain on the Triton kernels (interpreter): every stage and gradient pure."""
    report = chain_replay(model, repeats=2, backend="triton")
    assert report["backends"] and all(b.endswith(":triton") for b in report["backends"])
    for stage in report["flowlock"]["stages"]:
        assert stage["repeat_equal"] and stage["invariant"], stage
    assert all(g["repeat_equal"] for g in report["flowlock"]["grads"])
    assert report["flowlock"]["x_grad_invariant"] and report["ok"]
    assert _stage(report, "flowlock", "gate_residual")["local_vs_provider"]
