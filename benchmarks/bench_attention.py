"""Benchmark flowlock attention against the SDPA backends on one GPU, plus on-GPU evidence.

Runs, in one process: accuracy of forward and gradients against the FP64 golden on odd shapes
(budget from SDPA's own error), bitwise repeatability of flowlock's backward, batch invariance and
row purity, repeatability of cuDNN's backward, then timings at B=1, heads=56, D=128: flowlock vs
SDPA cuDNN / flash / efficient, forward and backward, alternating order, CUDA events, median after
warm-up, at S = 925 / 4253 / 16384 / 32768 by default; each flowlock row has its time over cuDNN's and
flash's (queued) and every row its share of the GPU's dense bf16 peak. TFLOP/s use 4*S^2*D*heads for
the forward and 2.5x that for the backward. ``host``
measures the host time of one public call and the amortized forward. ``--sweep S[,S]`` also times
candidate launch configs (tiles, warps, stages, TMA or pointer loads) at those sequence lengths,
compiling them first in worker processes and writing each result as it lands; ``--sections``
picks the sections to run. ``--compile-check`` needs no GPU: it compiles the candidates for sm90 on
this machine and reports shared memory, registers and spills.

By default the CPU test gate (``tests/ops/test_attention.py`` under the interpreter) runs first
and a red gate refuses the benchmark; ``--skip-gate`` skips it.

    PYTHONPATH=src python benchmarks/bench_attention.py --out results/attn.json
    python benchmarks/bench_attention.py --skip-gate --sections host --sweep-seq 16384 --out sweep.json
    TRITON_INTERPRET=0 python benchmarks/bench_attention.py --compile-check --out sm90_compile.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import harness
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


def time_ms(fn, queued: bool = False) -> float:
    """Milliseconds of one call between CUDA events, started on an idle device or, when ``queued``,
    enqueued behind a GPU spin (as inside a training step, where the host runs ahead)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if queued:
        torch.cuda._sleep(harness.QUEUE_SPIN_CYCLES)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def alternating_medians(fns: dict, iters: int, warmup: int, queued: bool = False) -> dict[str, float]:
    """Median milliseconds of each callable, rotating the call order every iteration."""
    names = list(fns)
    for _ in range(warmup):
        for n in names:
            fns[n]()
    samples = {n: [] for n in names}
    for i in range(iters):
        for n in names[i % len(names):] + names[:i % len(names)]:
            samples[n].append(time_ms(fns[n], queued))
    return {n: statistics.median(samples[n]) for n in names}


# Dense bf16 tensor-core peak (TFLOP/s, no sparsity) by device name: the SXM H100 and the H200 share it.
DENSE_PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4}


def dense_peak_tflops() -> float | None:
    """The dense bf16 peak of this GPU, or None for a GPU not in :data:`DENSE_PEAK_TFLOPS`."""
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in DENSE_PEAK_TFLOPS.items() if key in name), None)


def time_seq(impls: dict, seq: int, heads: int, dim: int, iters: int, warmup: int) -> list[dict]:
    """Per phase and implementation: the median of single calls from an idle device (``median_ms``)
    and queued behind a GPU spin (``median_ms_queued``, the throughput measure), each with
    flowlock's fraction of the fastest SDPA backend."""
    q, k, v, do = inputs(1, seq, heads, dim, seed=seq)
    fwd_flops = 4.0 * seq * seq * dim * heads
    fwd = {n: (lambda f=f: f(q, k, v)) for n, f in impls.items()}
    outs = {n: f(q, k, v) for n, f in impls.items()}
    bwd = {n: (lambda o=o: torch.autograd.grad(o, (q, k, v), do, retain_graph=True)) for n, o in outs.items()}
    rows = []
    for phase, fns, flops in (("fwd", fwd, fwd_flops), ("bwd", bwd, 2.5 * fwd_flops)):
        idle = alternating_medians(fns, iters, warmup)
        queued = alternating_medians(fns, iters, 1, queued=True)
        best = min((n for n in idle if n != "flowlock"), key=idle.get)
        best_queued = min((n for n in queued if n != "flowlock"), key=queued.get)
        peak = dense_peak_tflops()
        for n in fns:
            row = {"seq": seq, "phase": phase, "impl": n, "median_ms": idle[n], "tflops": flops / idle[n] / 1e9,
                   "median_ms_queued": queued[n], "tflops_queued": flops / queued[n] / 1e9, "samples": iters}
            if peak:
                row["share_of_dense_peak_queued"] = row["tflops_queued"] / peak
            if n == "flowlock":
                row.update(fastest_sdpa=best, fraction_of_fastest_sdpa=idle[best] / idle[n],
                           fastest_sdpa_queued=best_queued,
                           fraction_of_fastest_sdpa_queued=queued[best_queued] / queued[n])
                # time ratios (below 1: flowlock faster), queued: the throughput a training step sees
                row.update({f"time_over_{b}_queued": queued[n] / queued[b] for b in ("sdpa_cudnn", "sdpa_flash")
                            if b in queued})
            rows.append(row)
    return rows


def timings(attention, seqs, heads, dim, iters, warmup) -> list[dict]:
    impls = implementations(attention)
    rows = []
    for seq in seqs:
        rows += time_seq(impls, seq, heads, dim, iters, warmup)
        torch.cuda.empty_cache()
    return rows


# Sweep candidates of the separate kernels (BLOCK_M, BLOCK_N, num_warps, num_stages, TMA, DP_FIRST), most
# informative first: the frozen tiles, then dK/dV with 32-row query blocks (the 64-row ones need all 255
# registers and spill), the backward with dP issued before the exponentials, then other tiles and stage
# counts. dQ candidates fold per KV block as the frozen dQ config does (DQ_FOLD), so only those of its KV
# block width keep its bits. The last of each kernel exceed the 227 KB of shared memory an sm90 program may
# use (measured by compiling offline for sm90): kept to show the error, timed last. DP_FIRST does not apply
# to the forward.
SWEEP_CANDIDATES = {
    "fwd": [(128, 128, 8, 3, 1, 0), (128, 128, 8, 3, 0, 0), (128, 64, 8, 3, 1, 0), (128, 64, 4, 3, 1, 0),
            (128, 128, 8, 2, 1, 0), (128, 128, 8, 4, 1, 0)],
    "dkdv": [(64, 128, 8, 3, 1, 1), (64, 128, 8, 3, 1, 0), (32, 128, 8, 3, 1, 0), (32, 128, 8, 3, 1, 1),
             (32, 128, 8, 4, 1, 0), (32, 128, 8, 4, 1, 1), (32, 128, 8, 2, 1, 0), (64, 128, 8, 3, 0, 0),
             (128, 128, 8, 3, 1, 0)],
    "dq": [(128, 128, 8, 2, 1, 0), (128, 128, 8, 2, 1, 1), (128, 64, 8, 4, 1, 0), (128, 64, 8, 4, 1, 1),
           (128, 64, 8, 3, 1, 1), (128, 64, 8, 3, 1, 0), (128, 64, 8, 2, 1, 1), (64, 64, 4, 3, 1, 1),
           (128, 128, 8, 2, 0, 0), (128, 128, 8, 3, 1, 0)],
}


def sweep_order(kernels: Sequence[str] = tuple(SWEEP_CANDIDATES)) -> list[tuple[str, tuple[int, ...]]]:
    """Candidates of ``kernels`` interleaved by rank, so a time budget cuts the least informative."""
    chosen = {k: SWEEP_CANDIDATES[k] for k in kernels}
    depth = max(len(c) for c in chosen.values())
    return [(kernel, cands[i]) for i in range(depth) for kernel, cands in chosen.items() if i < len(cands)]


def frozen_config(op: str, dim: int, tma: int):
    """The frozen config of ``op`` on this GPU with its ``TMA`` key set to ``tma`` and no Gluon kernel
    (``ONE_PASS=0``, ``GLUON=0``: a sweep times the Triton kernels)."""
    from flowlock.config import launch_config
    from flowlock.keys import device_arch

    cfg = launch_config(op, torch.bfloat16, device_arch(torch.cuda.current_device()), (dim,))
    off = {key: 0 for key in ("ONE_PASS", "GLUON") if key in dict(cfg.blocks)}
    return cfg.with_blocks(TMA=tma, **off)


class SweepCase:
    """Inputs at one sequence length, the frozen tiles' outputs, and a call per (kernel, candidate):
    the forward, or the whole backward with one kernel's config replaced and the other kernel on its
    frozen tiles with the candidate's loads (TMA or pointer), so a failing variant cannot spoil the
    other's rows. References and ``out``/``lse2`` come from the pointer kernels (the TMA kernels give
    the same bits, tests/ops/test_attention_gpu.py)."""

    def __init__(self, seq: int, heads: int, dim: int, reference_backward: bool = True):
        from flowlock.ops.attention.triton import attention_bwd, attention_fwd

        self.q, self.k, self.v, self.do = inputs(1, seq, heads, dim, seed=seq, grad=False)
        self.scale, self.dim = dim ** -0.5, dim
        self._fwd, self._bwd = attention_fwd, attention_bwd
        self.out, self.lse2 = attention_fwd(self.q, self.k, self.v, self.scale, frozen_config("attention_fwd", dim, 0))
        self.reference = {"fwd": (self.out, self.lse2)}
        if reference_backward:
            self.reference["bwd"] = self.backward(frozen_config("attention_bwd_dkdv", dim, 0),
                                                  frozen_config("attention_bwd_dq", dim, 0))
        self.flops = 4.0 * seq * seq * dim * heads

    def backward(self, dkdv_config, dq_config):
        return self._bwd(self.do, self.q, self.k, self.v, self.out, self.lse2, self.scale, dkdv_config, dq_config)

    def call(self, kernel: str, cand: tuple[int, ...]):
        from flowlock.config import LaunchConfig

        bm, bn, warps, stages, tma, dp_first = cand
        blocks = {"BLOCK_M": bm, "BLOCK_N": bn, "DP_FIRST": dp_first, "TMA": tma}
        if kernel == "dq":
            blocks["DQ_FOLD"] = frozen_config("attention_bwd_dq", self.dim, tma)["DQ_FOLD"]
        cfg = LaunchConfig(tuple(sorted(blocks.items())), num_warps=warps, num_stages=stages)
        if kernel == "fwd":
            return lambda: self._fwd(self.q, self.k, self.v, self.scale, cfg)
        dkdv = cfg if kernel == "dkdv" else frozen_config("attention_bwd_dkdv", self.dim, tma)
        dq = cfg if kernel == "dq" else frozen_config("attention_bwd_dq", self.dim, tma)
        return lambda: self.backward(dkdv, dq)

    def same_bits_as_frozen_tiles(self, kernel: str, outs) -> bool:
        """Whether a candidate's outputs equal the frozen tiles' bit for bit (a candidate whose fold
        block differs from the frozen one may change them)."""
        return bitwise(outs, self.reference["fwd" if kernel == "fwd" else "bwd"])


def _precompile(args) -> list[str]:
    """Worker: run each candidate once (compiling it into Triton's on-disk cache); errors as text."""
    seq, heads, dim, cands = args
    case = SweepCase(seq, heads, dim, reference_backward=False)
    errors = []
    for kernel, cand in cands:
        try:
            case.call(kernel, cand)()
            torch.cuda.synchronize()
        except Exception as exc:  # recorded by the timing pass, which runs the same call again
            errors.append(f"{kernel} {cand}: {exc!r}"[:200])
    return errors


def precompile(seq: int, heads: int, dim: int, jobs: int, kernels: Sequence[str], timeout_s: float = 90.0) -> float:
    """Compile every candidate in ``jobs`` worker processes (Triton compiles serially within one
    process); the timing pass then loads them from the cache. Workers still busy after
    ``timeout_s`` are left to finish on their own. Returns the seconds spent."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    t0 = time.time()
    order = sweep_order(kernels)
    shares = [(seq, heads, dim, order[i::jobs]) for i in range(jobs)]
    pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"))
    try:
        list(pool.map(_precompile, shares, timeout=timeout_s))
    except Exception as exc:  # the timing pass compiles whatever the workers did not
        print(f"precompile incomplete: {exc!r}", flush=True)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return time.time() - t0


def window_ms(fn, calls: int) -> float:
    """Milliseconds per call over ``calls`` back-to-back calls between two CUDA events (the host
    time of each call overlaps the previous call's kernels)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def sweep(seq: int, heads: int, dim: int, windows: int, calls: int, budget_s: float, record,
          kernels: Sequence[str]) -> None:
    """Time every candidate (median of ``windows`` windows of ``calls`` calls after one warm-up call)
    and ``record(row)`` each at once; candidates left when ``budget_s`` has passed are recorded as
    skipped."""
    t0 = time.time()
    case = SweepCase(seq, heads, dim)
    for kernel, cand in sweep_order(kernels):
        row = {"seq": seq, "kernel": kernel, "cfg": list(cand[:4]), "tma": bool(cand[4]), "dp_first": bool(cand[5])}
        if time.time() - t0 > budget_s:
            record({**row, "skipped": f"sweep budget of {budget_s:.0f} s spent"})
            continue
        # backward rows time the whole backward (delta, dK/dV, dQ): 2.5x the forward's flops
        work = case.flops if kernel == "fwd" else 2.5 * case.flops
        try:
            call = case.call(kernel, cand)
            row["same_bits_as_frozen_tiles"] = case.same_bits_as_frozen_tiles(kernel, call())
            ms = statistics.median(window_ms(call, calls) for _ in range(windows))
            row.update(ms=ms, tflops=work / ms / 1e9)
        except Exception as exc:  # a config that does not fit the SM is recorded, not fatal
            row["error"] = repr(exc)[:300]
        record(row)


def host_overhead(attention, seq: int, heads: int, dim: int, calls: int = 50) -> dict:
    """Host microseconds per public call (time to return, kernels queued behind) with and without
    an autograd node, and the forward's milliseconds per call amortized over back-to-back calls,
    flowlock vs cuDNN."""
    q, k, v, _ = inputs(1, seq, heads, dim, seed=seq, grad=False)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    res = {"seq": seq}
    for label, fn in (("no_graph", lambda: attention(q, k, v)), ("graphed", lambda: attention(*leaves))):
        fn()
        torch.cuda.synchronize()
        host = []
        for _ in range(calls):
            t0 = time.perf_counter()
            fn()
            host.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
        res[f"host_us_{label}"] = statistics.median(host)
    cudnn = lambda: sdpa(SDPBackend.CUDNN_ATTENTION, q, k, v)
    cudnn()
    res["fwd_ms_amortized_flowlock"] = statistics.median(window_ms(lambda: attention(q, k, v), 10) for _ in range(3))
    res["fwd_ms_amortized_cudnn"] = statistics.median(window_ms(cudnn, 10) for _ in range(3))
    return res


def _ptxas_number(log: str, pattern: str) -> int | None:
    import re

    found = re.search(pattern, log)
    return int(found.group(1)) if found else None


def compile_check(dim: int, capability: int = 90) -> list[dict]:
    """Compile every sweep candidate for an sm90 GPU on this machine, no GPU needed (Triton's bundled
    ptxas): shared memory per program and registers and spills per thread, which decide whether a
    candidate fits (an sm90 program may use 227 KB). Needs ``TRITON_INTERPRET`` unset."""
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget

    from flowlock.ops.attention import triton as kernels

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    fns = {"fwd": kernels._attention_fwd_kernel, "dkdv": kernels._attention_bwd_dkdv_kernel,
           "dq": kernels._attention_bwd_dq_kernel}
    rows = []
    for kernel, cand in sweep_order():
        bm, bn, warps, stages, tma, dp_first = cand
        fn = fns[kernel].kernel
        boxes = {"Q": bm, "dOut": bm, "K": bn, "V": bn}
        sig, hints = {}, {}
        for i, name in enumerate(fn.arg_names):
            if name in boxes and tma:
                sig[name] = f"tensordesc<bf16[1,{boxes[name]},{dim}]>"
            elif name in ("Lse2", "Delta"):
                sig[name] = "*fp32"
            elif name in ("Q", "K", "V", "Out", "dOut", "dK", "dV", "dQ"):
                sig[name] = "*bf16"
            elif name in ("qk_scale", "sm_scale"):
                sig[name] = "fp32"
            else:
                sig[name] = "i32"
            if sig[name].startswith("*") or name.startswith("stride"):
                hints[(i,)] = [["tt.divisibility", 16]]
        consts = {"BLOCK_M": bm, "BLOCK_N": bn, "HEAD_DIM": dim, "BLOCK_D": dim, "UPCAST": False, "TMA": bool(tma)}
        if kernel != "fwd":
            consts["DP_FIRST"] = bool(dp_first)
        if kernel == "dq":
            consts["DQ_FOLD"] = True
        sig.update(dict.fromkeys(consts, "constexpr"))
        row = {"kernel": kernel, "cfg": [bm, bn, warps, stages], "tma": bool(tma), "dp_first": bool(dp_first)}
        try:
            compiled = triton.compile(triton.compiler.ASTSource(fn, sig, consts, hints),
                                      target=GPUTarget("cuda", capability, 128),
                                      options={"num_warps": warps, "num_stages": stages})
            with tempfile.TemporaryDirectory() as tmp:
                src = Path(tmp) / "k.ptx"
                src.write_text(compiled.asm["ptx"])
                log = subprocess.run([str(ptxas), "-v", f"--gpu-name=sm_{capability}a", str(src), "-o",
                                      str(Path(tmp) / "k.o")], capture_output=True, text=True).stderr
            row.update(shared_bytes=compiled.metadata.shared, registers=_ptxas_number(log, r"Used (\d+) registers"),
                       spill_store_bytes=_ptxas_number(log, r"(\d+) bytes spill stores"))
        except Exception as exc:  # recorded: a candidate the compiler refuses
            row["error"] = repr(exc)[:300]
        rows.append(row)
        print("compile", json.dumps(row), flush=True)
    return rows


def separate_configs(dim: int) -> tuple:
    """The separate Triton backward kernels at the frozen tiles, without the one-pass kernel: the dK/dV
    config with ``ONE_PASS=0``, the dQ config as frozen (dQ folded per 128-row KV block, the one-pass
    kernel's bits) and the chained dQ config frozen until the one-pass switch (one fp32 chain over all
    KV rows, 64-row KV blocks, four stages; other dQ bits), the baseline the one-pass kernel replaced."""
    from flowlock.config import launch_config
    from flowlock.keys import device_arch

    arch = device_arch(torch.cuda.current_device())
    dkdv = launch_config("attention_bwd_dkdv", torch.bfloat16, arch, (dim,)).with_blocks(ONE_PASS=0)
    fold_dq = launch_config("attention_bwd_dq", torch.bfloat16, arch, (dim,))
    chained_dq = dataclasses.replace(fold_dq.with_blocks(BLOCK_N=64, DQ_FOLD=0), num_stages=4)
    return dkdv, fold_dq, chained_dq


def one_pass(seqs, heads: int, dim: int, iters: int, head_groups: Sequence[int]) -> list[dict]:
    """The backward with the one-pass Gluon kernel (``ONE_PASS=G`` in the dK/dV config: tickets in groups
    of G heads) for each G in ``head_groups``, against the frozen backward, the separate kernels with dQ
    folded per 128-row KV block (the one-pass kernel's bits, checked for every G), the chained separate
    kernels it replaced (:func:`separate_configs`) and cuDNN's backward; queued medians, alternating order."""
    dkdv, fold_dq, chained_dq = separate_configs(dim)
    one_pass_dkdv = {g: dkdv.with_blocks(ONE_PASS=g) for g in head_groups}
    rows = []
    for seq in seqs:
        rows.append(_one_pass_row(seq, heads, dim, iters, one_pass_dkdv, dkdv, fold_dq, chained_dq))
        print("one_pass", json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    return rows


def _one_pass_row(seq: int, heads: int, dim: int, iters: int, one_pass_dkdv: dict, dkdv, fold_dq,
                  chained_dq) -> dict:
    from flowlock.ops.attention.triton import attention_bwd, attention_fwd

    q, k, v, do = inputs(1, seq, heads, dim, seed=seq)
    scale = dim ** -0.5
    with torch.no_grad():
        out, lse2 = attention_fwd(q, k, v, scale)
    cudnn_out = sdpa(SDPBackend.CUDNN_ATTENTION, q, k, v)
    one_pass = {f"one_pass_g{g}": functools.partial(attention_bwd, do, q, k, v, out, lse2, scale, dkdv_config=cfg)
                for g, cfg in one_pass_dkdv.items()}
    fns = {
        "frozen": lambda: attention_bwd(do, q, k, v, out, lse2, scale),
        "separate_fold": functools.partial(attention_bwd, do, q, k, v, out, lse2, scale, dkdv, fold_dq),
        "separate_chained": functools.partial(attention_bwd, do, q, k, v, out, lse2, scale, dkdv, chained_dq),
        **one_pass,
        "sdpa_cudnn": lambda: torch.autograd.grad(cudnn_out, (q, k, v), do, retain_graph=True),
    }
    want = fns["separate_fold"]()
    same = {f"{name}_bits_equal_separate_fold": bitwise(fns[name](), want) for name in ("frozen", *one_pass)}
    ms = alternating_medians(fns, iters, 2, queued=True)
    work = 2.5 * 4.0 * seq * seq * dim * heads
    best = min(one_pass, key=ms.get)
    return {"seq": seq, **same, **{f"{n}_ms": t for n, t in ms.items()},
            **{f"{n}_tflops": work / t / 1e9 for n, t in ms.items()},
            "one_pass_best": best, "one_pass_best_over_separate_chained": ms[best] / ms["separate_chained"],
            "one_pass_best_over_cudnn": ms[best] / ms["sdpa_cudnn"],
            "frozen_over_separate_chained": ms["frozen"] / ms["separate_chained"],
            "frozen_over_cudnn": ms["frozen"] / ms["sdpa_cudnn"],
            "separate_chained_over_cudnn": ms["separate_chained"] / ms["sdpa_cudnn"]}


# The Gluon forward's candidates: (KV ring stages, ping-pong of the two halves' products); the frozen one is
# gluon_fwd.RING, gluon_fwd.PINGPONG.
GLUON_FWD_CANDIDATES = ((3, False), (2, False), (3, True), (2, True))


def gluon_forward(seqs, heads: int, dim: int, iters: int) -> list[dict]:
    """The Gluon forward (:mod:`flowlock.ops.attention.gluon_fwd`) with each of
    :data:`GLUON_FWD_CANDIDATES` against the Triton forward of the frozen tiles (``GLUON=0``; out and
    lse2 bits compared, B = 1 and 2) and cuDNN's forward; queued medians at B = 1, alternating order."""
    from flowlock.config import launch_config
    from flowlock.keys import device_arch
    from flowlock.ops.attention import gluon_fwd
    from flowlock.ops.attention.triton import attention_fwd

    triton_cfg = launch_config("attention_fwd", torch.bfloat16, device_arch(torch.cuda.current_device()),
                               (dim,)).with_blocks(GLUON=0)
    rows = []
    for seq in seqs:
        scale = dim ** -0.5
        row = {"seq": seq}
        for batch in (2, 1):
            q, k, v, _ = inputs(batch, seq, heads, dim, seed=seq + batch, grad=False)
            fns = {"triton": functools.partial(attention_fwd, q, k, v, scale, triton_cfg),
                   **{f"gluon_r{r}{'_pp' if pp else ''}": functools.partial(gluon_fwd.attention_fwd_ws, q, k, v, scale,
                                                                             r, pp)
                      for r, pp in GLUON_FWD_CANDIDATES}}
            want = fns["triton"]()
            row.update({f"{n}_bits_equal_triton_b{batch}": bitwise(f(), want) for n, f in fns.items() if n != "triton"})
        fns["sdpa_cudnn"] = functools.partial(sdpa, SDPBackend.CUDNN_ATTENTION, q, k, v)
        ms = alternating_medians(fns, iters, 2, queued=True)
        work = 4.0 * seq * seq * dim * heads
        row.update({f"{n}_ms": t for n, t in ms.items()})
        row.update({f"{n}_tflops": work / t / 1e9 for n, t in ms.items()})
        row.update({f"{n}_over_triton": t / ms["triton"] for n, t in ms.items() if n != "triton"})
        row.update({f"{n}_over_cudnn": t / ms["sdpa_cudnn"] for n, t in ms.items() if n != "sdpa_cudnn"})
        rows.append(row)
        print("gluon_fwd", json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    return rows


SECTIONS = ("accuracy", "invariance", "host", "sweep", "timings", "one_pass", "gluon_fwd")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON output path (rewritten after every result)")
    parser.add_argument("--skip-gate", action="store_true", help="skip the CPU test gate")
    parser.add_argument("--seqs", default="925,4253,16384,32768")
    parser.add_argument("--one-pass-head-groups", default="2,4,8,16",
                        help="one_pass section: ticket head groups G to time (ONE_PASS=G), comma-separated")
    parser.add_argument("--heads", type=int, default=56)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--sweep", "--sweep-seq", dest="sweep", default="",
                        help="sequence lengths (comma-separated) for a config sweep; empty: none")
    parser.add_argument("--sweep-budget-s", type=float, default=110.0,
                        help="stop starting sweep candidates after this many seconds (per sequence length)")
    parser.add_argument("--sweep-kernels", default=",".join(SWEEP_CANDIDATES),
                        help=f"comma-separated subset of {tuple(SWEEP_CANDIDATES)} to sweep")
    parser.add_argument("--sweep-jobs", type=int, default=6, help="processes compiling sweep candidates (0: none)")
    parser.add_argument("--sections", default=",".join(s for s in SECTIONS
                                                       if s not in ("sweep", "one_pass", "gluon_fwd")),
                        help=f"comma-separated subset of {SECTIONS}; 'sweep' is added when --sweep is given")
    parser.add_argument("--compile-check", action="store_true",
                        help="only compile the sweep candidates for sm90 offline (no GPU) and report their resources")
    parser.add_argument("--commit", default=os.environ.get("FLOWLOCK_COMMIT", ""))
    args = parser.parse_args()
    if args.compile_check:
        Path(args.out).write_text(json.dumps({"compile_check_sm90": compile_check(args.dim)}, indent=1))
        return
    wanted = set(args.sections.split(",")) | ({"sweep"} if args.sweep else set())
    if wanted - set(SECTIONS):
        parser.error(f"unknown sections {sorted(wanted - set(SECTIONS))}")
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
    sweep_seqs = [int(s) for s in args.sweep.split(",") if s]
    kernels = [k for k in args.sweep_kernels.split(",") if k]
    if set(kernels) - set(SWEEP_CANDIDATES):
        parser.error(f"unknown sweep kernels {sorted(set(kernels) - set(SWEEP_CANDIDATES))}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        # rewritten after every result so a run cut short still leaves its evidence
        out.write_text(json.dumps(report, indent=1))

    def run_sweep() -> list[dict]:
        rows = report["sweep"] = []
        for seq in sweep_seqs:
            if args.sweep_jobs > 0:
                report[f"sweep_precompile_s_{seq}"] = precompile(seq, args.heads, args.dim, args.sweep_jobs,
                                                                 kernels)
                save()

            def record(row: dict) -> None:
                rows.append(row)
                print("sweep", json.dumps(row), flush=True)
                save()

            sweep(seq, args.heads, args.dim, windows=3, calls=3, budget_s=args.sweep_budget_s, record=record,
                  kernels=kernels)
            torch.cuda.empty_cache()
        return rows

    sections = {
        "accuracy": lambda: accuracy(attention, attention_golden),
        "invariance": lambda: invariance(attention),
        "host": lambda: [host_overhead(attention, s, args.heads, args.dim) for s in (4096,)],
        "sweep": run_sweep,
        "timings": lambda: timings(attention, seqs, args.heads, args.dim, args.iters, args.warmup),
        "one_pass": lambda: one_pass(seqs, args.heads, args.dim, args.iters,
                                     [int(g) for g in args.one_pass_head_groups.split(",")]),
        "gluon_fwd": lambda: gluon_forward(seqs, args.heads, args.dim, args.iters),
    }
    for name in SECTIONS:
        if name not in wanted:
            continue
        t0 = time.time()
        try:
            report[name] = sections[name]()
        except Exception as exc:  # keep what the other sections measured; the error is recorded
            report[name] = {"error": repr(exc)[:2000], "partial": report.get(name)}
        report[f"{name}_s"] = time.time() - t0
        print(name, json.dumps(report[name])[:4000], flush=True)
        save()


if __name__ == "__main__":
    main()
