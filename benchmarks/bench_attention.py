"""Benchmark flowlock attention against the SDPA backends on one GPU, plus on-GPU evidence.

Runs, in one process: accuracy of forward and gradients against the FP64 golden on odd shapes
(budget from SDPA's own error), bitwise repeatability of flowlock's backward, batch invariance and
row purity, repeatability of cuDNN's backward, then timings at B=1, heads=56, D=128: flowlock vs
SDPA cuDNN / flash / efficient, forward and backward, alternating order, CUDA events, median after
warm-up. TFLOP/s use 4*S^2*D*heads for the forward and 2.5x that for the backward. ``--sweep``
also times candidate launch configs at one sequence length.

By default the CPU test gate (``tests/ops/test_attention.py`` under the interpreter) runs first
and a red gate refuses the benchmark; ``--skip-gate`` skips it.

    PYTHONPATH=src python benchmarks/bench_attention.py --out results/attn.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = Path(__file__).resolve().parents[1]

SDPA_BACKENDS = {
    "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa_flash": SDPBackend.FLASH_ATTENTION,
    "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def run_gate() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "tests/ops/test_attention.py", "-q"]
    if subprocess.run(cmd, cwd=ROOT, env=env).returncode != 0:
        sys.exit("test gate failed: refusing to benchmark")


def sdpa(backend: SDPBackend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """SDPA on BSHD tensors through (B, heads, S, D) views."""
    with sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)


def implementations(attention):
    impls = {"flowlock": attention}
    for name, backend in SDPA_BACKENDS.items():
        impls[name] = lambda q, k, v, b=backend: sdpa(b, q, k, v)
    return impls


def inputs(batch: int, seq: int, heads: int, dim: int, seed: int, grad: bool = True):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda: torch.randn(batch, seq, heads, dim, device="cuda", generator=gen).bfloat16()
    q, k, v, do = make(), make(), make(), make()
    if grad:
        for t in (q, k, v):
            t.requires_grad_()
    return q, k, v, do


def forward_backward(fn, q, k, v, do):
    out = fn(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), do))


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def accuracy(attention, attention_golden) -> list[dict]:
    rows = []
    for batch, seq, heads, dim in ((2, 1, 3, 128), (2, 77, 3, 128), (1, 1000, 2, 128), (1, 4099, 2, 128),
                                   (2, 333, 2, 64)):
        q, k, v, do = inputs(batch, seq, heads, dim, seed=seq)
        ours = forward_backward(attention, q, k, v, do)
        base = forward_backward(lambda a, b, c: sdpa(SDPBackend.FLASH_ATTENTION, a, b, c), q, k, v, do)
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        gold = attention_golden(*leaves, dim ** -0.5, torch.bfloat16)
        golds = (gold.detach(), *torch.autograd.grad(gold, leaves, do.double()))
        for name, o, b, g in zip(("out", "dq", "dk", "dv"), ours, base, golds):
            budget = 2 * max_err(b, g) + torch.finfo(torch.bfloat16).eps * g.abs().max().item()
            err = max_err(o, g)
            rows.append({"shape": [batch, seq, heads, dim], "tensor": name, "err": err, "sdpa_err": max_err(b, g),
                         "budget": budget, "ok": err <= budget})
    return rows


def bitwise(a, b) -> bool:
    return all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(a, b))


def invariance(attention) -> dict:
    res = {}
    q, k, v, do = inputs(1, 4096, 56, 128, seed=1)
    runs = [forward_backward(attention, q, k, v, do) for _ in range(3)]
    res["flowlock_fwd_bwd_repeatable_3_runs_S4096_H56"] = all(bitwise(runs[0], r) for r in runs[1:])
    runs = [forward_backward(lambda a, b, c: sdpa(SDPBackend.CUDNN_ATTENTION, a, b, c), q, k, v, do)
            for _ in range(3)]
    res["cudnn_fwd_bwd_repeatable_3_runs_S4096_H56"] = all(bitwise(runs[0], r) for r in runs[1:])
    res["cudnn_mismatching_grad_elements"] = sum(int((x != y).sum()) for r in runs[1:] for x, y in zip(runs[0], r))

    q, k, v, do = inputs(3, 4099, 8, 128, seed=2, grad=False)
    alone = [forward_backward(attention, *(t[i:i + 1].clone().requires_grad_() for t in (q, k, v)), do[i:i + 1])
             for i in range(3)]
    for order in ([0, 1, 2], [2, 1, 0]):
        batch = forward_backward(attention, *(t[order].clone().requires_grad_() for t in (q, k, v)), do[order])
        ok = all(bitwise([x[pos:pos + 1] for x in batch], alone[i]) for pos, i in enumerate(order))
        res[f"batch_invariant_fwd_bwd_B3_order{''.join(map(str, order))}_S4099_H8"] = ok

    q2 = q.clone()
    q2[:, 1::2] = torch.randn_like(q2[:, 1::2])
    out1 = attention(q, k, v)
    out2 = attention(q2, k, v)
    res["row_pure_fwd_even_rows_S4099_H8"] = torch.equal(out1[:, ::2].view(torch.int16),
                                                         out2[:, ::2].view(torch.int16))
    return res


def time_ms(fn) -> float:
    """Milliseconds of one call between CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def alternating_medians(fns: dict, iters: int, warmup: int) -> dict[str, float]:
    """Median milliseconds of each callable, rotating the call order every iteration."""
    names = list(fns)
    for _ in range(warmup):
        for n in names:
            fns[n]()
    samples = {n: [] for n in names}
    for i in range(iters):
        for n in names[i % len(names):] + names[:i % len(names)]:
            samples[n].append(time_ms(fns[n]))
    return {n: statistics.median(samples[n]) for n in names}


def time_seq(impls: dict, seq: int, heads: int, dim: int, iters: int, warmup: int) -> list[dict]:
    q, k, v, do = inputs(1, seq, heads, dim, seed=seq)
    fwd_flops = 4.0 * seq * seq * dim * heads
    fwd = {n: (lambda f=f: f(q, k, v)) for n, f in impls.items()}
    outs = {n: f(q, k, v) for n, f in impls.items()}
    bwd = {n: (lambda o=o: torch.autograd.grad(o, (q, k, v), do, retain_graph=True)) for n, o in outs.items()}
    rows = []
    for phase, fns, flops in (("fwd", fwd, fwd_flops), ("bwd", bwd, 2.5 * fwd_flops)):
        medians = alternating_medians(fns, iters, warmup)
        best = min((n for n in medians if n != "flowlock"), key=medians.get)
        for n, med in medians.items():
            row = {"seq": seq, "phase": phase, "impl": n, "median_ms": med, "tflops": flops / med / 1e9,
                   "samples": iters}
            if n == "flowlock":
                row.update(fastest_sdpa=best, fraction_of_fastest_sdpa=medians[best] / med)
            rows.append(row)
    return rows


def timings(attention, seqs, heads, dim, iters, warmup) -> list[dict]:
    impls = implementations(attention)
    rows = []
    for seq in seqs:
        rows += time_seq(impls, seq, heads, dim, iters, warmup)
        torch.cuda.empty_cache()
    return rows


def sweep(seq, heads, dim, iters) -> list[dict]:
    """Time candidate launch configs (BLOCK_M, BLOCK_N, num_warps, num_stages) of each kernel; the
    backward varies one kernel while the other keeps its frozen config."""
    from flowlock.config import LaunchConfig
    from flowlock.ops.attention.triton import attention_bwd, attention_fwd

    def cfg(bm, bn, w, s):
        return LaunchConfig((("BLOCK_M", bm), ("BLOCK_N", bn)), num_warps=w, num_stages=s)

    q, k, v, do = inputs(1, seq, heads, dim, seed=seq, grad=False)
    scale = dim ** -0.5
    flops = 4.0 * seq * seq * dim * heads
    out, lse2 = attention_fwd(q, k, v, scale)
    candidates = {
        "fwd": [(128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 8, 4), (256, 64, 8, 2), (256, 128, 8, 2),
                (64, 128, 4, 3)],
        "dkdv": [(64, 128, 8, 3), (64, 128, 8, 4), (32, 128, 8, 4), (128, 128, 8, 2), (128, 64, 8, 3),
                 (64, 64, 4, 4)],
        "dq": [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (128, 32, 8, 4), (64, 64, 4, 4),
               (256, 64, 8, 2)],
    }
    calls = {
        "fwd": lambda c: attention_fwd(q, k, v, scale, c),
        "dkdv": lambda c: attention_bwd(do, q, k, v, out, lse2, scale, dkdv_config=c),
        "dq": lambda c: attention_bwd(do, q, k, v, out, lse2, scale, dq_config=c),
    }
    rows = []
    for kernel, cands in candidates.items():
        work = flops if kernel == "fwd" else 2.5 * flops
        for cand in cands:
            config = cfg(*cand)
            call = lambda c=config, kernel=kernel: calls[kernel](c)
            try:
                call()
                ms = statistics.median([time_ms(call) for _ in range(iters)])
                rows.append({"kernel": kernel, "cfg": list(cand), "ms": ms, "tflops": work / ms / 1e9})
            except Exception as exc:  # a config that does not fit the SM is recorded, not fatal
                rows.append({"kernel": kernel, "cfg": list(cand), "error": repr(exc)[:200]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON output path")
    parser.add_argument("--skip-gate", action="store_true", help="skip the CPU test gate")
    parser.add_argument("--seqs", default="4096,16384,32768")
    parser.add_argument("--heads", type=int, default=56)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--sweep", type=int, default=0, help="sequence length for a config sweep (0: none)")
    parser.add_argument("--commit", default=os.environ.get("FLOWLOCK_COMMIT", ""))
    args = parser.parse_args()
    if not args.skip_gate:
        run_gate()
    if not torch.cuda.is_available():
        sys.exit("bench_attention needs a CUDA GPU")
    import triton

    from flowlock.ops.attention import attention, attention_golden

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    commit = args.commit
    if not commit:
        git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        commit = git.stdout.strip() or "unknown"
    report = {"commit": commit, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "cuda": torch.version.cuda,
              "cudnn": torch.backends.cudnn.version(), "heads": args.heads, "dim": args.dim}
    seqs = [int(s) for s in args.seqs.split(",") if s]
    sections = [("accuracy", lambda: accuracy(attention, attention_golden)),
                ("invariance", lambda: invariance(attention))]
    if args.sweep:
        sections.append(("sweep", lambda: sweep(args.sweep, args.heads, args.dim, 10)))
    sections.append(("timings", lambda: timings(attention, seqs, args.heads, args.dim, args.iters, args.warmup)))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for name, section in sections:
        t0 = time.time()
        try:
            report[name] = section()
        except Exception as exc:  # keep what the other sections measured; the error is recorded
            report[name] = {"error": repr(exc)[:2000]}
        report[f"{name}_s"] = time.time() - t0
        print(name, json.dumps(report[name]), flush=True)
        # written after every section so a run cut short still leaves its evidence
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
