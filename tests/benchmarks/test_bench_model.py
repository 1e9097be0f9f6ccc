"""The full-depth model benchmark on CPU: flags, layout, the strict/stock switch, the JSON rows of a
tiny run (a failing variant recorded, not fatal), the gate refusal, merging runs, the plot and the
``flowlock bench model`` pass-through."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_model  # noqa: E402
import harness  # noqa: E402
import plot  # noqa: E402

import flowlock  # noqa: E402
from flowlock import cli  # noqa: E402

TINY_RUN = ["--smoke", "--skip-gate", "--device", "cpu", "--seq", "24", "--layers", "1", "--iters", "1",
            "--warmup", "0", "--breakdown-seq", "24"]


def test_layout_rows():
    for s in bench_model.FULL_SEQ:
        layout = bench_model.model_packing(s)
        assert layout.seq_len == s
        assert layout.text_indices.numel() == 256 and layout.audio_indices.numel() == s // 16


def test_flags():
    args = harness.parse_args("x", ["--out", "o.json"], bench_model._extra, iters=3, warmup=1)
    assert (args.iters, args.warmup, args.fullgraph) == (3, 1, True)
    assert args.measures == ["forward", "step"] and args.variants is None  # main: all on CUDA, plain on CPU
    args = harness.parse_args("x", ["--out", "o.json", "--seq", "925", "16384", "--measures", "step",
                                    "--variants", "strict_eager,stock_compiled", "--no-fullgraph"], bench_model._extra)
    assert args.seq == [925, 16384] and args.measures == ["step"] and not args.fullgraph
    assert args.variants == ["strict_eager", "stock_compiled"]
    with pytest.raises(SystemExit):
        harness.parse_args("x", ["--out", "o.json", "--measures", "backward"], bench_model._extra)


def test_paths_switch_strict_and_stock_on_one_model():
    from flowlock.models.minimax_h3.tiny import TINY_H3_CONFIG, tiny_inputs

    model = bench_model.build_model(dict(TINY_H3_CONFIG, num_layers=1), torch.device("cpu"))
    assert model.proj_in.weight.dtype == torch.float32
    assert model.transformer_blocks[0].norm1.weight.dtype == torch.bfloat16
    handle = flowlock.patch(model)
    block = model.transformer_blocks[0]
    patched = block.__dict__["forward"]
    marker = object()
    paths = bench_model.Paths(model, handle, {block: marker})
    inputs = tiny_inputs(1)
    with torch.no_grad():
        paths.use("stock_compiled")
        assert "forward" not in block.__dict__ and block._compiled_call_impl is marker
        paths.use("stock_eager")
        assert block._compiled_call_impl is None
        stock = model(**inputs, return_dict=False)
        paths.use("strict_eager")
        assert block.__dict__["forward"] is patched
        strict = model(**inputs, return_dict=False)
        with flowlock.mode("provider"):
            provider = model(**inputs, return_dict=False)
    assert all(torch.equal(a, b) for a, b in zip(stock, provider))
    handle.remove()
    assert "forward" not in block.__dict__
    assert strict[0].shape == stock[0].shape


def _failing_compile(model, fullgraph, backend, mode=None):
    def fail(*args, **kwargs):
        raise RuntimeError("recompile_limit reached with fullgraph=True (test)")
    return {m: fail for m in model.modules() if type(m).__name__ in model._repeated_blocks}


def test_tiny_run_rows_and_plot(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_model, "compile_blocks", _failing_compile)
    out = tmp_path / "model.json"
    # config.patch restores what main() sets; monkeypatch's undo would delete (hide) the option.
    with torch._dynamo.config.patch(recompile_limit=torch._dynamo.config.recompile_limit):
        assert bench_model.main(TINY_RUN + ["--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["benchmark"] == "model" and payload["complete"] and payload["gate"]["ran"] is False
    assert {"git_commit", "gpu", "torch", "triton"} <= set(payload["environment"])
    assert [(r["S"], r["measure"]) for r in payload["rows"]] == [(24, "forward"), (24, "step")]
    for row in payload["rows"]:
        for key in ("strict_eager_s", "strict_compiled_s", "stock_eager_s", "stock_compiled_s", "strict_peak_gib",
                    "stock_peak_gib", "strict_over_stock_eager", "strict_over_stock_compiled"):
            assert key in row
        assert row["strict_eager_s"] > 0 and row["stock_eager_s"] > 0
        assert row["strict_compiled_s"] is None and row["strict_over_stock_compiled"] is None
        assert set(row["errors"]) == {"strict_compiled", "stock_compiled"}
        assert "recompile_limit" in row["errors"]["strict_compiled"]
        eager = row["variants"]["strict_eager"]
        assert eager["n"] == 1 and eager["min_s"] <= eager["median_s"] <= eager["max_s"]
        assert row["strict_over_stock_eager"] == pytest.approx(row["strict_eager_s"] / row["stock_eager_s"])
        trained = payload["parameter_tensors"] if row["measure"] == "step" else 0
        assert eager["params_with_grad"] == row["variants"]["stock_eager"]["params_with_grad"] == trained
    step = payload["rows"][1]["breakdown"]
    assert set(step) == {"strict_eager", "stock_eager"}
    assert step["stock_eager"]["total_ms"] > 0 and step["stock_eager"]["top"]
    assert payload["rows"][1]["gpu_idle"] == {"strict_eager": None, "stock_eager": None}  # CPU: no CUDA timeline
    png = plot.plot(out)
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_a_graphed_variant_that_cannot_be_captured_is_recorded(tmp_path):
    out = tmp_path / "model.json"
    assert bench_model.main(TINY_RUN + ["--variants", "strict_eager,strict_graphed", "--measures", "step",
                                        "--out", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert row["strict_eager_s"] > 0 and row["strict_graphed_s"] is None
    assert "capture" in row["errors"]["strict_graphed"] and "CUDA tensor" in row["errors"]["strict_graphed"]
    assert set(row["breakdown"]) == {"strict_eager"}


def test_row_ratios_take_the_fastest_path_of_each_side():
    layout = bench_model.model_packing(925)
    medians = {"strict_eager": 4.0, "strict_compiled": 3.0, "strict_graphed": 2.0, "stock_eager": 5.0,
               "stock_compiled": 2.5, "stock_compiled_graphed": 1.6}
    row = bench_model.make_row(925, "step", layout, {v: {"median_s": t} for v, t in medians.items()})
    assert row["best_strict"] == "strict_graphed" and row["best_stock"] == "stock_compiled_graphed"
    assert row["strict_over_stock_compiled"] == pytest.approx(2.0 / 2.5)
    assert row["strict_over_best_stock"] == pytest.approx(2.0 / 1.6)
    assert row["strict_graphed_over_stock_compiled_graphed"] == pytest.approx(2.0 / 1.6)
    assert row["stock_graphed_s"] is None and row["strict_compiled_over_stock_compiled"] == pytest.approx(1.2)


def test_red_gate_refuses_before_building(tmp_path, monkeypatch):
    red = tmp_path / "test_red.py"
    red.write_text("def test_red():\n    assert False\n")
    monkeypatch.setattr(bench_model, "GATE_TESTS", (str(red),))
    monkeypatch.setattr(bench_model, "build_model", lambda *a, **k: pytest.fail("built a model on a red gate"))
    with pytest.raises(SystemExit) as exc:
        bench_model.main(["--smoke", "--device", "cpu", "--out", str(tmp_path / "o.json")])
    assert exc.value.code == 2 and not (tmp_path / "o.json").exists()


def _run(commit, rows):
    return {"benchmark": "model", "complete": True, "environment": {"git_commit": commit, "gpu": "H200"},
            "gate": {"ran": False}, "settings": {}, "rows": [{"S": s, "measure": m} for s, m in rows]}


def test_merge_joins_one_commit_only(tmp_path):
    a = harness.write_json(tmp_path / "a.json", _run("abc", [(16384, "step")]))
    b = harness.write_json(tmp_path / "b.json", _run("abc", [(925, "step"), (925, "forward")]))
    merged = json.loads(bench_model.merge([a, b], tmp_path / "m.json").read_text())
    assert [(r["S"], r["measure"]) for r in merged["rows"]] == [(925, "forward"), (925, "step"), (16384, "step")]
    assert [r["file"] for r in merged["runs"]] == ["a.json", "b.json"]
    other = harness.write_json(tmp_path / "c.json", _run("def", [(4253, "step")]))
    with pytest.raises(SystemExit, match="git_commit"):
        bench_model.merge([a, other], tmp_path / "x.json")
    with pytest.raises(SystemExit, match="twice"):
        bench_model.merge([a, a], tmp_path / "x.json")


def test_kernel_groups():
    assert bench_model.group_of("cudnn_generated_fort_native_sdpa_sm90_flash_fprop") == "attention"
    assert bench_model.group_of("_attention_bwd_dkdv_kernel") == "attention"
    assert bench_model.group_of("sm90_xmma_gemm") == "gemm"
    assert bench_model.group_of("_linear_gemm_tma_kernel") == "gemm"
    assert bench_model.group_of("nvjet_tst_128x256") == "gemm"
    assert bench_model.group_of("_scatter_rows_fwd_kernel") == "copy/fill"
    assert bench_model.group_of("_rms_norm_modulate_fwd") == "other"


def test_cli_bench_model_passes_flags_and_is_not_a_default(monkeypatch):
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append([str(c) for c in cmd])
        return subprocess.CompletedProcess(cmd, 0, stdout="--smoke", stderr="")

    monkeypatch.setattr(cli.subprocess, "run", fake_run)
    assert cli.main(["bench", "model", "--seq", "925", "--measures", "step"]) == 0
    script = [c for c in calls if c[1].endswith("bench_model.py")]
    assert script[0][2:4] == ["--out", str(cli._repo_root() / "benchmarks" / "results" / "model.json")]
    assert script[0][4:] == ["--seq", "925", "--measures", "step"]
    calls.clear()
    assert cli.main(["bench", "--smoke"]) == 0
    assert calls and not any(c[1].endswith("bench_model.py") for c in calls)
    with pytest.raises(SystemExit):
        cli.main(["check", "--seq", "925"])
