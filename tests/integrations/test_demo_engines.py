"""``flowlock demo --rollout vllm-omni`` and ``flowlock trace --rollout vllm-omni`` on the tiny H3 with
the real vLLM-Omni classes: strict is exactly on-policy across engines (a synced LoRA included),
a planted strict divergence is found and named, and the refusals are clear.

The CLI installs no shim; on this CPU host the test does (tests/vllm_omni_env.py: SDPA backend
with a CPU forward), as CI must for vLLM-Omni to build at all."""

import importlib.util
import json

from vllm_omni_env import ensure_runtime

import flowlock
import flowlock.integrations.vllm_omni.minimax_h3.forward as native_forward
from flowlock.cli import main
from flowlock.integrations.vllm_omni import install
from flowlock.integrations.vllm_omni.runtime import native_from_diffusers
from flowlock.models.minimax_h3 import TINY_H3_CONFIG, make_h3
from flowlock.validate.engines import ROLLOUT_WIDTHS, run_engine_consistency

ensure_runtime()


def _perturb_rollout_residual(monkeypatch):
    # the rollout's strict gated residual off by one part in 64: the trainer's is untouched
    real = native_forward.gate_residual
    monkeypatch.setattr(native_forward, "gate_residual", lambda *a, **kw: real(*a, **kw) * (1.0 + 2.0 ** -6))


def test_demo_across_engines_reports_zero_strict_mismatches(tmp_path, capsys):
    path = tmp_path / "demo.json"
    status = main(["demo", "--rollout", "vllm-omni", "--device", "cpu", "--samples", "3", "--steps", "2",
                   "--json", str(path)])
    text = capsys.readouterr().out
    report = json.loads(path.read_text())
    strict = report["consistency"]["strict"]
    assert status == 0 and report["ok"], text
    assert strict["bitwise_equal"] and strict["requests_per_forward"] == 3 and len(strict["per_step"]) == 2
    assert all(s["velocity_mismatches"] == 0 and s["logp_mismatches"] == 0 and s["max_abs_dlogp"] == 0.0
               for s in strict["per_step"])
    assert report["trace"]["strict"]["divergence"] is None and report["trace"]["strict"]["compared"] >= 8
    assert "LoRA" in report["adapter"] and "stock" in text and "exactly on-policy across engines: yes" in text


def test_consistency_run_catches_a_planted_divergence(monkeypatch):
    _perturb_rollout_residual(monkeypatch)
    diffusers_model = make_h3({**TINY_H3_CONFIG, **ROLLOUT_WIDTHS}, seed=0)
    native_model = native_from_diffusers(diffusers_model)
    with flowlock.patch(diffusers_model), install(native_model):
        report = run_engine_consistency(diffusers_model, native_model, n_requests=2, steps=1, mode="strict")
    assert not report["bitwise_equal"] and report["per_step"][0]["logp_mismatches"] > 0


def test_trace_across_engines_names_the_first_module_that_differs(monkeypatch, capsys):
    assert main(["trace", "--rollout", "vllm-omni", "--device", "cpu"]) == 0
    assert "trace strict: no module differs" in capsys.readouterr().out
    _perturb_rollout_residual(monkeypatch)
    assert main(["trace", "--rollout", "vllm-omni", "--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "trace strict: first module that differs: transformer_blocks.0 (vLLM-Omni blocks.0)" in out, out


def test_without_vllm_omni_the_cross_engine_demo_says_so(monkeypatch, capsys):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm_omni" else
                        find_spec(name, *a))
    assert main(["demo", "--rollout", "vllm-omni", "--device", "cpu"]) == 2
    assert "needs vllm 0.30.0 and vllm-omni 0.30.0 installed" in capsys.readouterr().err


def test_a_platform_without_an_attention_backend_is_reported(monkeypatch, capsys):
    from vllm_omni.diffusion.attention import selector
    from vllm_omni.platforms.interface import UnspecifiedOmniPlatform

    def none(cls, *args, **kwargs):
        raise NotImplementedError("no diffusion attention backend")

    # what a CPU host without the test shim has; the selector caches resolved backends
    monkeypatch.setattr(UnspecifiedOmniPlatform, "get_diffusion_attn_backend_cls", classmethod(none))
    selector._cached_get_backend_cls.cache_clear()
    assert main(["demo", "--rollout", "vllm-omni", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "selects no diffusion attention backend on cpu" in err and "run the cross-engine demo on a GPU" in err


def test_default_rollout_is_diffusers():
    from flowlock.cli import build_parser

    assert build_parser().parse_args(["demo"]).rollout == "diffusers"
    assert build_parser().parse_args(["trace"]).rollout == "diffusers"
