"""``benchmarks/bench_launch_host.py --smoke`` end to end on CPU: every shape and product has both
host times and equal bits, and the run leaves the launchers' own plan tables and kernels in place."""

import json

from flowlock.ops.linear import gluon as lg
from flowlock.ops.linear import gluon_stream as gs
from flowlock.ops.linear import triton as lt


def test_smoke_run_times_both_ways_and_restores_the_plan_table(tmp_path, load_bench):
    bench = load_bench("bench_launch_host")
    import plot
    tables = lt._TMA_PLANS, lg._PLANS, gs._PLANS
    out = tmp_path / "host.json"
    assert bench.main(["--smoke", "--skip-gate", "--device", "cpu", "--iters", "1", "--warmup", "0", "--calls", "1",
                       "--out", str(out)]) == 0
    assert all(now is kept for now, kept in zip((lt._TMA_PLANS, lg._PLANS, gs._PLANS), tables))
    assert not any("prepared" in vars(kernel) for kernel in bench._TritonOnly.KERNELS)
    report = json.loads(out.read_text())
    assert [r["shape"] for r in report["rows"]] == list(bench.SMOKE_SHAPES) and report["all_bits_equal"]
    for row in report["rows"]:
        for product in ("forward", "dx", "dw"):
            assert row[product]["prepared_us"] > 0 and row[product]["triton_us"] > 0, row
    png = plot.plot(out)
    assert png.read_bytes()[:4] == b"\x89PNG"
