"""``tools/h200_degree1.py`` on CPU (gloo, tiny H3): every degree-1 variant gives plain strict's bits,
the Ulysses-1 variant engages the context-parallel config and, one rank holding every row, runs the
plain forward (no collective at all, so degree 1 costs nothing by construction), the
vLLM-Omni TP = 1 rollout equals diffusers strict and issues no collective, and the comparison
catches a one-bit difference in one parameter gradient."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "h200_degree1.py"


def _script():
    spec = importlib.util.spec_from_file_location("h200_degree1", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_run_every_degree1_path_gives_plain_strict_bits(tmp_path):
    out = tmp_path / "degree1.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--device", "cpu", "--iters", "5", "--out",
                           str(out)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    variants = report["train"]["variants"]
    assert set(variants) == {"plain", "ulysses1", "fsdp1", "fsdp1_ulysses1", "stock", "stock_fsdp1"}
    for name, v in variants.items():
        assert "error" not in v, (name, v)
        assert v["step"]["n"] == 5 and v["step"]["median_ms"] > 0
        if name.startswith("stock"):
            assert v["bitwise_equal"] is None and "param_grads" not in v, (name, v)
        elif name != "plain":
            assert v["bitwise_equal"] and v["param_grads_equal"] == v["param_grads"] > 50, (name, v)
    assert variants["stock"]["collectives_in_step"] == {}
    assert variants["stock_fsdp1"]["fsdp2_units"] == variants["fsdp1"]["fsdp2_units"] > 5
    assert variants["stock"]["fsdp2_units"] == variants["plain"]["fsdp2_units"] == 0
    attribution = report["train"]["attribution"]
    assert set(attribution) == {"fsdp1_over_plain", "stock_fsdp1_over_stock", "ulysses1_over_plain",
                                "plain_over_stock"} and all(r > 0 for r in attribution.values()), attribution
    for name, v in variants.items():
        profile = v["profile"]
        assert profile["gpu_ms"] > 0 and profile["kernels"] and profile["host"]["by_own_time"], (name, profile)
    gpu = report["train"]["gpu_attribution"]
    assert gpu["fsdp1_minus_plain_gpu_ms"] == (variants["fsdp1"]["profile"]["gpu_ms"]
                                               - variants["plain"]["profile"]["gpu_ms"])
    assert {"stock_fsdp1_adds", "ulysses1_adds"} <= set(gpu)
    assert variants["plain"]["collectives_in_step"] == {}
    for name in ("ulysses1", "fsdp1_ulysses1"):
        assert "must be greater than 1" in variants[name]["diffusers_refused"]
        assert variants[name]["collectives_in_step"] == {}
    roll = report["rollout"]
    if importlib.util.find_spec("vllm_omni") is not None:
        assert "error" not in roll, roll
        assert roll["bitwise_equal_to_diffusers_strict"] and roll["collectives_in_strict_forward"] == {}
        assert set(roll["forward"]) == {"vllm_omni_tp1_strict", "diffusers_strict"}
    else:
        assert "not importable" in roll["skipped"]
    assert report["environment"]["torch"] == torch.__version__


def test_compare_catches_one_bit_in_one_parameter_gradient():
    script = _script()
    grad = torch.randn(4, 3).to(torch.bfloat16)
    ref = {"outputs": [torch.ones(2)], "latent_grads": [torch.ones(1)] * 3, "param_grads": {"a": grad, "b": grad}}
    flipped = grad.clone()
    flipped.view(torch.int16)[1, 2] ^= 1
    got = {**ref, "param_grads": {"a": grad.clone(), "b": flipped}}
    result = script.compare(got, ref)
    assert not result["bitwise_equal"] and result["differing_param_grads"] == ["b"]
    assert result["outputs_and_latent_grads_equal"] and result["param_grads_equal"] == 1
    assert script.compare({**ref}, ref)["bitwise_equal"]
