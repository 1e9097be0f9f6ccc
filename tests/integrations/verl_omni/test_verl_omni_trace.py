"""``flowlock trace --rollout verl-omni`` on the tiny H3 with the real vLLM-Omni classes: strict replays
every recorded log-prob, and a planted divergence in the rollout engine is named by transition and
module. The CLI installs no shim; the test does (tests/vllm_omni_env.py), as CI must."""

import json

from vllm_omni_env import ensure_runtime

import flowlock.integrations.vllm_omni.minimax_h3.forward as native_forward
from flowlock.cli import main

ensure_runtime()


def test_strict_replays_every_recorded_log_prob(tmp_path, capsys):
    path = tmp_path / "trace.json"
    status = main(["trace", "--rollout", "verl-omni", "--device", "cpu", "--json", str(path)])
    text = capsys.readouterr().out
    report = json.loads(path.read_text())
    assert status == 0 and report["ok"], text
    assert report["strict"] == {"replays": 4, "divergence": None}
    assert "strict: every replayed log-prob equals the rollout's (4 replays)" in text


def test_a_rollout_engine_divergence_is_named_by_transition_and_module(tmp_path, capsys, monkeypatch):
    real = native_forward.gate_residual
    # the rollout's strict gated residual off by one part in 64; the actor's is untouched
    monkeypatch.setattr(native_forward, "gate_residual", lambda *a, **kw: real(*a, **kw) * (1.0 + 2.0 ** -6))
    path = tmp_path / "trace.json"
    status = main(["trace", "--rollout", "verl-omni", "--device", "cpu", "--json", str(path)])
    text = capsys.readouterr().out
    divergence = json.loads(path.read_text())["strict"]["divergence"]
    assert status == 1, text
    assert (divergence["request"], divergence["transition"], divergence["grid_step"]) == (0, 0, 1)
    assert divergence["max_abs_dlogp"] > 0
    assert divergence["module"]["module"] == "transformer_blocks.0", divergence
    assert "first module that differs: transformer_blocks.0 (vLLM-Omni blocks.0)" in text
