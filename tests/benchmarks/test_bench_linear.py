"""``benchmarks/bench_linear.py --variant`` on CPU: the frozen configs with blocks set are checked
bitwise against the frozen ones and timed against them and against the stock GEMM."""

import math

import torch


def test_variant_checks_the_bits_and_times_forward_and_dx(load_bench):
    """The interpreter's configs run the pointer kernel; the variant switches on the persistent TMA
    walk with stream-K (4 tiles of 16 x 16 on 3 programs: one round and a tail, shared out), a
    different schedule whose bits must still be the frozen config's."""
    bench = load_bench("bench_linear")
    rows = bench._variant(torch.device("cpu"), {"out": (32, 40)}, [32], math.inf, {"TMA": 1, "STREAM_K": 1})
    assert [(r["op"], r["tiles"]) for r in rows] == [("linear_fwd", 4), ("linear_dx", 6)]
    assert rows[0]["stream_k"] and not rows[1]["stream_k"]
    for row in rows:
        assert row["same_bits"] and row["variant"] == {"TMA": 1, "STREAM_K": 1}, row
        assert row["queued"]["variant_ms"] > 0 and row["queued"]["cublas_ms"] > 0, row


def test_variant_times_dw_when_asked(load_bench):
    """``ops`` picks the products: dW alone, its tiles counted over the weight's (N, K)."""
    bench = load_bench("bench_linear")
    rows = bench._variant(torch.device("cpu"), {"out": (32, 40)}, [32], math.inf, {"TMA": 1}, ("linear_dw",))
    assert [(r["op"], r["tiles"]) for r in rows] == [("linear_dw", 6)]
    assert rows[0]["same_bits"] and rows[0]["queued"]["cublas_ms"] > 0, rows[0]
