"""``benchmarks/bench_memory_bound.py --smoke`` end to end on CPU: every op and phase is timed against
a copy of its bytes, the bytes follow the widths, rows carry their modality's table row, and the
result plots."""

import json

import torch


def test_modality_rows_follow_bench_model_layout(load_bench):
    bench = load_bench("bench_memory_bound")
    index = bench._modality_index(4253, torch.device("cpu"))
    assert index.tolist() == [0] * (4253 - 256 - 265) + [1] * 265 + [2] * 256


def test_smoke_run_times_every_op_against_a_copy(tmp_path, load_bench):
    bench = load_bench("bench_memory_bound")
    import plot

    out = tmp_path / "memory_bound.json"
    assert bench.main(["--smoke", "--skip-gate", "--device", "cpu", "--iters", "20", "--warmup", "0",
                       "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    phases = [(r["op"], r["phase"]) for r in report["rows"]]
    assert phases == [(op, phase) for op in ("rms_norm_modulate", "qk_norm_rope", "gate_residual", "swiglu")
                      for phase in ("forward", "backward")] + [("segment_sum", "forward")]
    w, s = bench.SMOKE, bench.SMOKE_SEQS[0]
    by = {(r["op"], r["phase"]): r for r in report["rows"]}
    assert by["swiglu", "forward"]["bytes"] == 3 * s * w.ffn * 2
    assert by["qk_norm_rope", "backward"]["bytes"] == 3 * s * w.heads * w.head_dim * 2 + 2 * s * w.rope * 4
    for row in report["rows"]:
        assert row["S"] == s and row["ms"] > 0 and row["copy_ms"] > 0, row
        assert row["of_copy"] == row["copy_ms"] / row["ms"]
    png = plot.plot(out)
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_kernels_gives_a_phases_time_per_launch(load_bench):
    """``--kernels``' profile of one phase: a per-call time for each launch (on CPU, each op's CPU time),
    largest first."""
    bench = load_bench("bench_memory_bound")
    device = torch.device("cpu")
    phase = bench.cases(bench.SMOKE_SEQS[0], bench.SMOKE, device)["rms_norm_modulate"]["backward"]
    times = [k["ms"] for k in bench.kernels(phase, device)]
    assert times and all(t > 0 for t in times) and times == sorted(times, reverse=True), times


def test_norm_dw_blocks_keeps_the_bits_and_times_each(load_bench):
    """``--norm-dw-blocks``: the norm's backward with other dweight column blocks, each checked bitwise
    against the frozen config (the smoke widths run the interpreter config, whose tile is summed as one
    tree: the check still has to hold) and timed against it."""
    bench = load_bench("bench_memory_bound")
    rows = bench.norm_dw_blocks(40, bench.SMOKE, torch.device("cpu"), [8, 16], iters=20, warmup=0)
    assert [r["BLOCK_C"] for r in rows] == [8, 16]
    for row in rows:
        assert row["same_bits"] and row["ms"] > 0 and row["frozen_ms"] > 0, row


def test_one_segment_keeps_the_bits_and_times_each_launch(load_bench):
    """``--one-segment``: the three launches that write segment partials, each with ONE_SEGMENT against
    without, checked bitwise and timed (smoke widths: the interpreter config, 40 rows in one tile of
    three segments, so the launch takes the every-segment path both ways)."""
    bench = load_bench("bench_memory_bound")
    rows = bench.one_segment(40, bench.SMOKE, torch.device("cpu"), iters=20, warmup=0)
    assert [r["op"] for r in rows] == ["segment_sum_partials", "gate_residual_backward", "rms_norm_modulate_backward"]
    for row in rows:
        assert row["same_bits"] and row["one_segment_ms"] > 0 and row["every_segment_ms"] > 0, row
