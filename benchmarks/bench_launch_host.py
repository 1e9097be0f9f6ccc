"""Host time of flowlock's GEMM launches at a short sequence: prepared TMA launches vs Triton's launch.

At S = 925 the strict training step is host-bound: the GPU waits for launches. For each H3 GEMM
shape (qkv, out, fc1, fc2) and product (forward, dX, dW) at M tokens this times, in one process,
the host microseconds of one launcher call in two ways, alternating: as the step runs it (the
first call of a shape goes through Triton and keeps its prepared launch; later calls relaunch it
with tensor maps encoded once per address) and with every call through Triton's own launch (an
empty plan table and no preparation: a ``TensorDescriptor`` per operand, the binder's
specialization, the map encodings). Both ways must give the same bits (``torch.equal``), checked
on the same operands.

Host time is wall time of ``calls`` back-to-back launcher calls with no synchronization inside,
so it measures the launch path while the GPU queue absorbs the work (the GPU runs far behind).

Run: ``PYTHONPATH=src python benchmarks/bench_launch_host.py --out benchmarks/results/launch_host.json``
(``--smoke``: tiny shapes on CPU under TRITON_INTERPRET=1, where no launch is prepared: it checks
the script, measures nothing).
"""

from __future__ import annotations

import statistics
import time

import harness
import torch

import flowlock
from flowlock.ops.linear import gluon as lg
from flowlock.ops.linear import gluon_stream as gs
from flowlock.ops.linear import triton as lt

SHAPES = {"qkv": (21504, 5376), "out": (5376, 7168), "fc1": (28672, 5376), "fc2": (5376, 14336)}
SMOKE_SHAPES = {"qkv": (48, 32), "fc2": (32, 48)}
BF16 = torch.bfloat16


class _TritonOnly:
    """Inside: every GEMM launch takes its compiler's own path (Triton's, or Gluon's for the kernels the
    forward and dX run on sm90, panel stream-K's included): empty plan tables, and the kernels prepare
    nothing, so no plan is built either; the launchers' own tables and kernels come back after."""

    KERNELS = (lt._linear_gemm_tma_kernel, lg._linear_gemm_ws_kernel, gs._linear_fwd_stream_kernel)

    def __enter__(self):
        self.tables = lt._TMA_PLANS, lg._PLANS, gs._PLANS
        lt._TMA_PLANS, lg._PLANS, gs._PLANS = {}, {}, {}
        for kernel in self.KERNELS:
            kernel.prepared = lambda *args, **kwargs: None

    def __exit__(self, *exc):
        for kernel in self.KERNELS:
            del kernel.prepared
        lt._TMA_PLANS, lg._PLANS, gs._PLANS = self.tables


def _extra(parser):
    parser.add_argument("--m", type=int, default=925, help="token rows M (default 925)")
    parser.add_argument("--calls", type=int, default=50, help="launcher calls per timed sample")


def _products(x, w, dy):
    return {"forward": lambda: lt.linear_fwd(x, w, None, BF16),
            "dx": lambda: lt.linear_dx(dy, w, BF16),
            "dw": lambda: lt.linear_dw(dy, x, w, BF16)}


def _host_us(fn, calls: int, device: torch.device) -> float:
    """Host microseconds per call over ``calls`` unsynchronized calls (synchronized before and after)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 1e6 * elapsed / calls


def _case(name, shape, m, device, args) -> dict:
    n, k = shape
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, k, generator=g, device=device).to(BF16)
    w = (torch.randn(n, k, generator=g, device=device) / k**0.5).to(BF16)
    dy = torch.randn(m, n, generator=g, device=device).to(BF16)
    row = {"shape": name, "m": m, "n": n, "k": k}
    for product, fn in _products(x, w, dy).items():
        fn()
        prepared_out = fn()
        with _TritonOnly():
            triton_out = fn()
        samples = {"prepared": [], "triton": []}
        for _ in range(args.warmup + args.iters):
            samples["prepared"].append(_host_us(fn, args.calls, device))
            with _TritonOnly():
                samples["triton"].append(_host_us(fn, args.calls, device))
        med = {way: statistics.median(s[args.warmup:]) for way, s in samples.items()}
        row[product] = {"prepared_us": med["prepared"], "triton_us": med["triton"],
                        "saved_us": med["triton"] - med["prepared"],
                        "bits_equal": torch.equal(prepared_out, triton_out)}
    return row


def main(argv=None) -> int:
    args = harness.parse_args(__doc__.splitlines()[0], argv, _extra, iters=7, warmup=2)
    gate = harness.gate_or_exit(args, ["tests/ops/test_linear.py", "tests/ops/test_launch_descriptors.py"])
    device = torch.device("cpu" if args.smoke else args.device)
    if device.type != "cuda" and not args.smoke:
        raise SystemExit("bench_launch_host needs a CUDA device (or --smoke under TRITON_INTERPRET=1)")
    shapes, m = (SMOKE_SHAPES, 7) if args.smoke else (SHAPES, args.m)
    env = harness.environment(device)
    payload = {"benchmark": "launch_host", "smoke": args.smoke, "environment": env, "gate": gate,
               "settings": {"m": m, "calls": args.calls, "iters": args.iters, "warmup": args.warmup}, "rows": []}
    with flowlock.use_backend("triton"):
        for name, shape in shapes.items():
            payload["rows"].append(_case(name, shape, m, device, args))
            print(payload["rows"][-1], flush=True)
    products = [row[p] for row in payload["rows"] for p in ("forward", "dx", "dw")]
    payload["all_bits_equal"] = all(p["bits_equal"] for p in products)
    payload["mean_saved_us_per_gemm"] = statistics.fmean(p["saved_us"] for p in products)
    harness.write_json(args.out, payload)
    return 0 if payload["all_bits_equal"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
