"""The ``flowlock`` command line end to end on CPU: demo (strict must be exactly on-policy; both paths'
counts in its JSON, its plot, its wording), check and trace exit codes and reports, help text for
every flag, bench refusing unknown names."""

import argparse
import importlib
import json

import pytest

from flowlock.cli import build_parser, main
from flowlock.validate.demo import REPLAY_BATCHINGS
from flowlock.validate.suites import SUITES

gate_residual_module = importlib.import_module("flowlock.ops.gate_residual")  # the family, not the op


def test_demo_end_to_end(tmp_path, capsys):
    out_json, out_png = tmp_path / "demo.json", tmp_path / "demo.png"
    status = main(["demo", "--device", "cpu", "--json", str(out_json), "--plot", str(out_png),
                   "--samples", "3", "--steps", "2", "--rounds", "1"])
    text = capsys.readouterr().out
    report = json.loads(out_json.read_text())
    assert [(r["replay_micro_batch"], r["replay_order"]) for r in report["consistency"]] == list(REPLAY_BATCHINGS)
    for run in report["consistency"]:
        strict, stock = run["strict"], run["provider"]
        assert strict["rollout_batch"] == stock["rollout_batch"] == 3
        assert all(step["logp_mismatches"] == 0 and step["velocity_mismatches"] == 0 for step in strict["per_step"])
        assert strict["max_abs_dlogp"] == 0.0 and strict["bitwise_equal"]
        assert len(strict["per_step"]) == len(stock["per_step"]) == 2
        for step in stock["per_step"]:
            assert step["velocity_elements"] > 0 and 0 <= step["velocity_mismatches"] <= step["velocity_elements"]
            assert 0 <= step["logp_mismatches"] <= 3
    assert report["chain"]["ok"] and report["trace"]["strict"]["divergence"] is None and report["ok"] and status == 0
    assert set(report["timing"]["median_s"]) == {"strict", "provider"} and report["timing"]["rounds"] == 1
    assert out_png.read_bytes()[:4] == b"\x89PNG"
    lines = text.splitlines()
    assert lines[0].startswith("flowlock demo: tiny embedded H3") and lines[0].endswith("on cpu")
    for path in ("strict", "stock"):
        assert any(line.startswith(f"{path}:") and "velocity elements and" in line and "log-probs differ" in line
                   for line in lines), path
    assert sum(line.startswith("stock's drift on this machine: ") for line in lines) == 1
    if all(run["provider"]["bitwise_equal"] for run in report["consistency"]):
        assert "stock agreed bitwise between rollout and replay in every replay batching checked here" in text
        assert "On a GPU it does. NVIDIA H200, benchmarks/results/" in text
    assert "time per RL step" in text and "median of 1 round after 1 warm-up round" in text
    assert "strict path exactly on-policy here: yes" in text
    for jargon in ("chained = provider", "local = provider", "no (", "first stage where strict and provider part",
                   "ops ran on"):
        assert jargon not in text


def test_trace_exit_code_and_report(tmp_path, capsys):
    path = tmp_path / "trace.json"
    assert main(["trace", "--device", "cpu", "--json", str(path)]) == 0
    results = json.loads(path.read_text())
    assert results["strict"]["divergence"] is None
    out = capsys.readouterr().out
    assert "  strict: no module differs" in out and "  stock : " in out


def test_check_passes_and_says_what_each_suite_covers(tmp_path, capsys):
    assert main(["check", "--device", "cpu", "--json", str(tmp_path / "check.json")]) == 0
    out = capsys.readouterr().out
    assert "FAIL" not in out
    results = json.loads((tmp_path / "check.json").read_text())
    assert set(results) == {suite.name for suite in SUITES}
    for suite in SUITES:
        line = next(line for line in out.splitlines() if f"| {suite.name} " in line)
        assert line.startswith("PASS") and suite.covers in line


def test_check_fails_on_planted_non_invariance(monkeypatch, tmp_path, capsys):
    real = gate_residual_module.gate_residual

    def batch_dependent(residual, gate, y, index, **kw):
        return real(residual, gate, y, index, **kw) * (1.0 + 2.0 ** -6 * (residual.shape[0] - 1))

    monkeypatch.setattr(gate_residual_module, "gate_residual", batch_dependent)
    assert main(["check", "--device", "cpu", "--json", str(tmp_path / "check.json")]) == 1
    assert not json.loads((tmp_path / "check.json").read_text())["chain"]["passed"]
    assert any(line.startswith("FAIL") and "| chain " in line for line in capsys.readouterr().out.splitlines())


def test_bench_unknown_name_fails(capsys):
    assert main(["bench", "no_such_benchmark"]) == 1
    assert "no_such_benchmark" in capsys.readouterr().err


def test_parser_requires_a_command():
    with pytest.raises(SystemExit):
        build_parser().parse_args([])
    args = build_parser().parse_args(["demo"])
    assert args.device == "auto" and args.samples == 4 and args.steps == 3 and args.rounds == 5 and args.model is None


@pytest.mark.parametrize("command", ["demo", "check", "trace", "bench"])
def test_every_flag_has_help_text(command):
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    missing = [a.option_strings or a.dest for a in sub._actions
               if not isinstance(a, argparse._HelpAction) and not a.help]
    assert missing == []


@pytest.mark.parametrize("flag", ["--samples", "--steps", "--rounds", "--layers"])
def test_counts_must_be_positive_before_anything_runs(flag, capsys):
    with pytest.raises(SystemExit):
        main(["demo", flag, "0"])
    assert f"argument {flag}: must be a positive integer, got 0" in capsys.readouterr().err


def test_a_sequence_too_short_is_refused_before_any_model(capsys):
    assert main(["demo", "--seq", "3"]) == 2
    assert "--seq 3: a sequence of 3 rows is too short" in capsys.readouterr().err


@pytest.mark.parametrize("extra", [["--plot", "x.png"], ["--rounds", "3"], ["--seq", "64"], ["--width", "full"]])
def test_cross_engine_demo_refuses_flags_it_would_ignore(extra, capsys):
    assert main(["demo", "--rollout", "vllm-omni", *extra]) == 2
    assert f"does not take {extra[0]}" in capsys.readouterr().err


def test_model_dir_loads_checkpoint_dtypes(tmp_path):
    """``--model DIR`` loads a diffusers checkpoint with its mixed precision (FP32 modules kept)."""
    import torch

    from flowlock.models.minimax_h3.tiny import tiny_h3
    from flowlock.testing import bitwise_equal
    from flowlock.validate.demo import load_model

    saved = tiny_h3(seed=5)
    saved.save_pretrained(tmp_path / "ckpt")
    loaded, origin = load_model(str(tmp_path / "ckpt"), torch.device("cpu"))
    assert "ckpt" in origin and not loaded.training
    reference = saved.state_dict()
    for name, tensor in loaded.state_dict().items():
        assert bitwise_equal(tensor, reference[name]), name
    assert loaded.time_embedder.linear_1.weight.dtype == torch.float32
    assert loaded.transformer_blocks[0].adaln_proj.linear.weight.dtype == torch.bfloat16


def test_trace_fails_on_planted_strict_divergence(monkeypatch, capsys):
    """gate_residual made batch-dependent inside the strict path: the first block is the first divergence."""
    import flowlock.models.minimax_h3.strict as strict_module

    real = strict_module.gate_residual

    def batch_dependent(residual, gate, y, index, **kw):
        return real(residual, gate, y, index, **kw) * (1.0 + 2.0 ** -6 * (residual.shape[0] - 1))

    monkeypatch.setattr(strict_module, "gate_residual", batch_dependent)
    assert main(["trace", "--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "  strict: first differs at transformer_blocks.0 (" in out, out
