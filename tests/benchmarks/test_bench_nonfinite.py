"""``benchmarks/bench_nonfinite.py --smoke`` end to end on CPU: the check alone, the model check and the
forward with the non-finite check on and off are all timed and written."""

import json


def test_smoke_run_times_the_check_and_the_forward_both_ways(tmp_path, load_bench):
    bench = load_bench("bench_nonfinite")
    out = tmp_path / "nonfinite.json"
    assert bench.main(["--smoke", "--skip-gate", "--device", "cpu", "--warmup", "0", "--measures", "forward",
                       "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["check"]["median_ms"] > 0 and report["model_check"]["median_ms"] > 0
    row = report["rows"]["forward"]
    assert row["on"]["n"] == row["off"]["n"] == 20 and row["ratio_on_over_off"] > 0
