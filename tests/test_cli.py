"""The ``flowlock`` command line end to end on CPU: demo (strict must be exactly on-policy), check
and trace exit codes, bench refusing unknown names."""

import importlib
import json

import pytest

from flowlock.cli import build_parser, main

gate_residual_module = importlib.import_module("flowlock.ops.gate_residual")  # the family, not the op


def test_demo_end_to_end(tmp_path, capsys):
    out_json, out_png = tmp_path / "demo.json", tmp_path / "demo.png"
    status = main(["demo", "--device", "cpu", "--json", str(out_json), "--plot", str(out_png),
                   "--samples", "3", "--steps", "2"])
    text = capsys.readouterr().out
    report = json.loads(out_json.read_text())
    strict = report["consistency"]["strict"]
    assert all(step["logp_mismatches"] == 0 for step in strict["per_step"]), strict["per_step"]
    assert all(step["velocity_mismatches"] == 0 for step in strict["per_step"])
    assert strict["max_abs_dlogp"] == 0.0 and strict["bitwise_equal"]
    assert report["chain"]["ok"] and report["ok"] and status == 0
    assert len(strict["per_step"]) == 2 and len(report["consistency"]["provider"]["per_step"]) == 2
    assert out_png.read_bytes()[:4] == b"\x89PNG"
    assert "on cpu" in text and ":reference" in text
    assert "conditioning chain" in text and "RL consistency" in text
    provider = report["consistency"]["provider"]
    if provider["bitwise_equal"]:
        assert "looks batch-invariant" in text.replace("\n", " ")


def test_trace_exit_code_and_report(tmp_path, capsys):
    path = tmp_path / "trace.json"
    assert main(["trace", "--device", "cpu", "--json", str(path)]) == 0
    results = json.loads(path.read_text())
    assert results["strict"]["divergence"] is None
    assert "provider" in capsys.readouterr().out


def test_check_passes(capsys):
    assert main(["check", "--device", "cpu"]) == 0
    assert "FAIL" not in capsys.readouterr().out


def test_check_fails_on_planted_non_invariance(monkeypatch, capsys):
    real = gate_residual_module.gate_residual

    def batch_dependent(residual, gate, y, index, **kw):
        return real(residual, gate, y, index, **kw) * (1.0 + 2.0 ** -6 * (residual.shape[0] - 1))

    monkeypatch.setattr(gate_residual_module, "gate_residual", batch_dependent)
    assert main(["check", "--device", "cpu"]) == 1
    assert "FAIL  chain" in capsys.readouterr().out


def test_bench_unknown_name_fails(capsys):
    assert main(["bench", "no_such_benchmark"]) == 1
    assert "no_such_benchmark" in capsys.readouterr().err


def test_parser_requires_a_command():
    with pytest.raises(SystemExit):
        build_parser().parse_args([])
    args = build_parser().parse_args(["demo"])
    assert args.device == "auto" and args.samples == 4 and args.steps == 3 and args.model is None


def test_model_dir_loads_checkpoint_dtypes(tmp_path):
    """``--model DIR`` loads a diffusers checkpoint with its mixed precision (FP32 modules kept)."""
    import torch

    from flowlock.cli import _load_model
    from flowlock.models.minimax_h3.tiny import tiny_h3
    from flowlock.testing import bitwise_equal

    saved = tiny_h3(seed=5)
    saved.save_pretrained(tmp_path / "ckpt")
    loaded, origin = _load_model(str(tmp_path / "ckpt"), torch.device("cpu"))
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
    assert "strict  : first divergence at transformer_blocks.0 " in out, out
