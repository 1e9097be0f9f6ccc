"""Benchmark machinery: paired timing alternates and excludes setup, the gate refuses red tests,
JSON and plots are written."""

import json
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import harness  # noqa: E402
import plot  # noqa: E402


def test_time_pair_alternates_order_and_excludes_setup():
    calls = []

    def setup(tag):
        def make():
            calls.append(f"setup_{tag}")
            return tag
        return make

    result = harness.time_pair(lambda s: calls.append(s), lambda s: calls.append(s), device=torch.device("cpu"),
                               setup_a=setup("a"), setup_b=setup("b"), iters=20, warmup=2)
    runs = [c for c in calls if not c.startswith("setup")]
    firsts = runs[0::2]
    assert firsts == ["a", "b"] * 11
    assert calls[:2] == ["setup_a", "a"]
    assert result["a"]["n"] == result["b"]["n"] == 20
    for stats in (result["a"], result["b"]):
        assert stats["p20_ms"] <= stats["median_ms"] <= stats["p80_ms"]
    assert result["ratio_a_over_b"] == pytest.approx(result["a"]["median_ms"] / result["b"]["median_ms"])


def test_time_pair_needs_twenty_iterations():
    with pytest.raises(ValueError, match="iters"):
        harness.time_pair(lambda s: None, lambda s: None, device=torch.device("cpu"), iters=5)


def test_time_rounds_rotates_records_failures_and_calls_after():
    calls, after = [], []

    def fn(tag):
        def run(state):
            calls.append((tag, state))
            if tag == "c" and len(calls) > 3:
                raise RuntimeError("recompile limit")
        return run

    setups = {k: (lambda k=k: k.upper()) for k in "abc"}
    result = harness.time_rounds({k: fn(k) for k in "abc"}, device=torch.device("cpu"), setups=setups, rounds=3,
                                 warmup=1, after=after.append)
    assert [t for t, _ in calls[:3]] == ["a", "b", "c"] and [t for t, _ in calls[3:5]] == ["b", "c"]
    assert all(state == tag.upper() for tag, state in calls)
    assert result["c"] == {"error": "RuntimeError: recompile limit"}
    for key in "ab":
        r = result[key]
        assert r["n"] == 3 and len(r["warmup_ms"]) == 1 and r["min_ms"] <= r["median_ms"] <= r["max_ms"]
    # round 1 starts at b, round 2 at c (dropped), round 3 at a again
    assert [t for t, _ in calls[5:]] == ["a", "a", "b", "a", "b"] and after == ["b", "a", "a", "b", "a", "b"]


def test_idle_gaps_charge_each_gap_to_the_activity_that_ended_it():
    # (start_us, end_us, name): a 5 us gap before b, an overlap of c with b, a 200 us gap before the second a.
    spans = [(0.0, 10.0, "a_1"), (15.0, 30.0, "b"), (20.0, 40.0, "c"), (240.0, 250.0, "a_2")]
    got = harness.idle_gaps(spans, name_of=lambda name: name.split("_")[0])
    assert got["gpu_busy_ms"] == pytest.approx(0.045) and got["gpu_span_ms"] == pytest.approx(0.250)
    assert got["gpu_idle_ms"] == pytest.approx(0.205)
    assert (got["gaps_over_10us"], got["gaps_over_100us"]) == (1, 1)
    assert got["idle_before"] == [{"kernel": "a", "idle_ms": pytest.approx(0.200), "gaps": 1},
                                  {"kernel": "b", "idle_ms": pytest.approx(0.005), "gaps": 1}]
    assert harness.idle_gaps([]) == {"kernels": 0}
    assert harness.gpu_idle(lambda: None, torch.device("cpu")) is None


def test_gate_refuses_failing_tests(tmp_path):
    red = tmp_path / "test_red.py"
    red.write_text("def test_red():\n    assert False\n")
    green = tmp_path / "test_green.py"
    green.write_text("import os\n\ndef test_green():\n    assert os.environ['TRITON_INTERPRET'] == '1'\n")
    assert harness.test_gate([str(green)])["passed"] is True
    record = harness.test_gate([str(red)])
    assert record["ran"] and record["passed"] is False
    args = harness.parse_args("x", ["--out", str(tmp_path / "o.json")])
    with pytest.raises(SystemExit) as exc:
        harness.gate_or_exit(args, [str(red)])
    assert exc.value.code == 2
    skipped = harness.parse_args("x", ["--out", "o.json", "--skip-gate"])
    assert harness.gate_or_exit(skipped, [str(red)]) == {"ran": False, "passed": None, "args": [str(red)]}


def test_environment_and_json(tmp_path):
    env = harness.environment(torch.device("cpu"))
    assert env["torch"] == torch.__version__ and env["gpu"] is None
    assert set(env) >= {"git_commit", "git_dirty", "date_utc", "cuda", "triton", "diffusers"}
    path = harness.write_json(tmp_path / "sub" / "r.json", {"environment": env, "x": 1})
    assert json.loads(path.read_text())["x"] == 1


def _stats(ms):
    return {"median_ms": ms, "p20_ms": ms * 0.9, "p80_ms": ms * 1.1, "n": 20}


def test_plots_are_written(tmp_path):
    cond = {"benchmark": "conditioning", "smoke": True, "environment": {"device": "cpu"}, "results": [
        {"op": "timestep_mlp", "S": None, "T": 1, "forward": {"speedup": 1.5}, "backward": {"speedup": 0.8}},
        {"op": "gate_residual", "S": 33, "T": 1, "forward": {"speedup": 2.0}, "backward": {"speedup": 1.2}},
        {"op": "gate_residual", "S": 65, "T": 1, "forward": {"speedup": 2.5}, "backward": {"speedup": 1.1}},
    ]}
    block = {"benchmark": "block", "environment": {"gpu": "H200", "git_commit": "abc"}, "results": [
        {"S": s, "forward": {"strict_over_provider": 0.9}, "forward_backward": {"strict_over_provider": 1.1},
         "peak_memory_bytes": {"strict": 2**30, "provider": None}} for s in (40, 64)]}
    tp = {"benchmark": "tp_designs", "environment": {"gpu": "H200", "git_commit": "abc"}, "rows": [
        {"S": s, "gemm": g, "tp": t, "stock_ms": 1.0 / t, "a_ms": 1.2 / t, "b_ms": 3.0 / t}
        for s in (925, 4253) for g in ("out_proj", "fc2") for t in (1, 2, 4, 8)]}
    for name, payload in (("cond", cond), ("block", block), ("tp", tp)):
        src = harness.write_json(tmp_path / f"{name}.json", payload)
        png = plot.plot(src)
        assert png == tmp_path / f"{name}.png" and png.read_bytes()[:4] == b"\x89PNG"
    unknown = harness.write_json(tmp_path / "u.json", {"benchmark": "nope", "results": []})
    with pytest.raises(ValueError, match="no plot"):
        plot.plot(unknown)


def test_block_layout_fractions_and_kernel_groups():
    from flowlock.models.minimax_h3.packing import packing_for_length

    for s in (40, 64, 4096, 16384):
        layout = packing_for_length(s)
        assert layout.seq_len == s
        text, audio = layout.text_indices.numel(), layout.audio_indices.numel()
        assert abs(text - 0.05 * s) <= 1 and 0.15 * s - 1 <= audio <= 0.15 * s + max(64, 0.02 * s)
    assert harness.kernel_prefix("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm>(Params)") == \
        "cutlass::Kernel2"
    assert harness.kernel_prefix("_linear_fwd_kernel") == "_linear_fwd_kernel"
    assert harness.kernel_prefix("aten::mm") == "aten::mm"
    assert harness.kernel_prefix("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize") == "sm90_xmma_gemm"
