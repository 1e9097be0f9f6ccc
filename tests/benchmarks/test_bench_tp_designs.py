"""``benchmarks/bench_tp_designs.py --smoke`` end to end on CPU: every TP row times the three designs,
design (a)'s rank rows equal the TP = 1 GEMM's rows, and TP > 1 rows carry the counted bytes."""

import json
import sys


def test_smoke_run_times_every_design_at_every_tp(tmp_path, load_bench):
    bench = load_bench("bench_tp_designs")
    out = tmp_path / "tp.json"
    assert bench.main(["--smoke", "--skip-gate", "--device", "cpu", "--iters", "1", "--warmup", "0",
                       "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert {(r["gemm"], r["tp"]) for r in report["rows"]} == {(g, t) for g in ("out_proj", "fc2") for t in bench.TPS}
    for row in report["rows"]:
        assert row["a_rows_equal_tp1_rows"], row
        assert all(row[f"{d}_ms"] > 0 for d in ("stock", "a", "b")), row
        assert (row["mb_received_per_rank_per_block_both_gemms"] is None) == (row["tp"] == 1), row
    assert len(report["tp1_cost"]) == 2 and all(r["b_over_strict_at_tp1"] > 0 for r in report["tp1_cost"])
    assert "tp_traffic" in sys.modules
