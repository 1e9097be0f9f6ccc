"""The demo report in plain words: counts for both paths, stock's drift in one line, the committed
GPU run beside a machine where stock agreed, what the time ratio compares."""

import json
from pathlib import Path

from flowlock.validate.demo import GPU_RUN, gpu_evidence
from flowlock.validate.demo_report import demo_blocks
from flowlock.validate.report import Table, plain

ROOT = Path(__file__).resolve().parents[2]
JARGON = ("chained = provider", "local = provider", "no (", "first stage where strict and provider part",
          "ops ran on")
DIVERGENCE = {"position": 2, "module": "audio_proj_in", "output": 0, "kind": "values", "mismatches": 108,
              "numel": 448, "max_abs_diff": 2.4e-7, "max_abs_ref": 2.5}


def _text(payload) -> str:
    return "\n".join(plain(b) if isinstance(b, Table) else b for b in demo_blocks(payload))


def test_stock_agreeing_is_said_exactly_with_the_gpu_run_beside_it(demo_payload):
    gpu = gpu_evidence(ROOT)
    text = _text(demo_payload(gpu_evidence=gpu, trace_divergence=DIVERGENCE))
    lines = text.splitlines()
    assert lines[0] == "flowlock demo: tiny embedded H3 (random weights) on cpu"
    assert "strict: 0 of 6000 velocity elements and 0 of 24 log-probs differ between rollout and replay" in lines
    assert "stock:  0 of 6000 velocity elements and 0 of 24 log-probs differ between rollout and replay" in lines
    drift = next(line for line in lines if line.startswith("stock's drift on this machine: "))
    assert "first differs at audio_proj_in" in drift and "108 of 448 elements" in drift
    assert "the model's output is still the same bits" in drift
    assert "the conditioning chain is not batch-invariant at timestep_mlp" in drift
    assert ("stock agreed bitwise between rollout and replay in every replay batching checked here "
            "(1 per forward, reversed order; 3 per forward, shuffled order)") in text
    gpu_line = next(line for line in lines if line.startswith("On a GPU it does."))
    assert GPU_RUN[0] in gpu_line and GPU_RUN[1] in gpu_line
    assert "stock: 963433 of 963456 velocity elements and 12 of 12 log-probs differ" in gpu_line
    assert "strict: 0 of 963456 and 0 of 12" in gpu_line
    assert not any(word in text for word in JARGON), text


def test_without_the_checkout_the_gpu_run_is_pointed_to_not_invented(demo_payload):
    text = _text(demo_payload(gpu_evidence=None))
    assert "is not in this installation" in text and "On a GPU it does" not in text
    assert "stock's drift on this machine: the conditioning chain is not batch-invariant at timestep_mlp" in text


def test_stock_drift_in_the_rl_step_is_counted_and_needs_no_gpu_line(demo_payload):
    text = _text(demo_payload(stock=(7, 0, 3), stock_logp=(2, 0, 1), stock_dlogp=(1e-6, 0.0, 3e-7),
                              trace_divergence=DIVERGENCE, output_differs=True))
    assert "stock:  20 of 6000 velocity elements and 6 of 24 log-probs differ between rollout and replay" in text
    assert "the model's output differs too" in text
    assert "agreed bitwise" not in text and "On a GPU" not in text
    table = next(line for line in text.splitlines() if line.startswith("1 per forward, reversed order |    0"))
    assert "7 of 1000" in table and "2 of 4" in table and "1.0e-06" in table


def test_the_time_line_says_what_it_measured_and_what_the_ratio_compares(demo_payload):
    line = next(line for line in _text(demo_payload()).splitlines() if line.startswith("time per RL step"))
    assert "median of 5 rounds after 1 warm-up round" in line and "alternating" in line
    assert "strict 0.500 s, stock 0.100 s; strict / stock = 5.00 (above 1: strict is slower)" in line
    assert "PyTorch reference ops" in line


def test_gpu_evidence_reads_the_committed_run_and_the_new_format(tmp_path):
    committed = gpu_evidence(ROOT)
    assert committed["gpu"] == "NVIDIA H200" and committed["seq_len"] == 1024
    assert committed["batchings"] == [(1, "reversed")]
    assert committed["provider"]["velocity_mismatches"] == 963433 and committed["strict"]["velocity_mismatches"] == 0
    assert gpu_evidence(tmp_path) is None
    old = json.loads((ROOT / GPU_RUN[0]).read_text())
    new = {**old, "consistency": [{"replay_micro_batch": 1, "replay_order": "reversed", **old["consistency"]}] * 2}
    (tmp_path / GPU_RUN[0]).parent.mkdir(parents=True)
    (tmp_path / GPU_RUN[0]).write_text(json.dumps(new))
    doubled = gpu_evidence(tmp_path)
    assert doubled["provider"]["velocity_mismatches"] == 2 * 963433 and doubled["provider"]["log_probs"] == 24
