"""flowlock ``linear`` vs cuBLAS on the H3 GEMM shapes: forward, dX, dW, plus GPU invariance checks.

For qkv (5376 -> 21504), out (7168 -> 5376), fc1 (5376 -> 28672) and fc2 (14336 -> 5376) at
M in {4096, 16384, 32768}: flowlock's forward (public ``linear``), dX and dW launchers against
``F.linear``, ``dy @ w`` and ``dy.T @ x`` (bf16, cuBLAS), timed with ``harness.time_pair``. On the
GPU it also checks bitwise repeatability, M-invariance (row slices vs the full batch), fused qkv vs
separate q, k, v, swapped fc1 halves, the dW token-unit fold, and accuracy against float64.
``--sweep`` times candidate launch configs (same BLOCK_R, so the same bits) to choose the frozen ones.

Run: ``PYTHONPATH=src python benchmarks/bench_linear.py --out benchmarks/results/linear.json``.
"""

from __future__ import annotations

import dataclasses
import time

import harness
import torch
import torch.nn.functional as F

import flowlock
from flowlock.config import LaunchConfig, launch_config
from flowlock.keys import arch_of
from flowlock.ops.linear import linear
from flowlock.ops.linear import triton as lt

SHAPES = {"qkv": (21504, 5376), "out": (5376, 7168), "fc1": (28672, 5376), "fc2": (5376, 14336)}
# --beside: the layers whose dX and dW the model runs (q, k and v are separate linears there)
BESIDE_SHAPES = {"q": (7168, 5376), "out": (5376, 7168), "fc1": (28672, 5376), "fc2": (5376, 14336)}
MS = (4096, 16384, 32768)
# --smoke: the same script on tiny shapes under the Triton interpreter (TRITON_INTERPRET=1), CPU.
SMOKE_SHAPES = {"qkv": (48, 32), "out": (32, 40), "fc1": (64, 32), "fc2": (32, 48)}
SMOKE_MS = (40,)
BF16 = torch.bfloat16


def _extra(parser):
    parser.add_argument("--quick", action="store_true", help="sweep two shapes (one per K class) only")
    parser.add_argument("--sweep-only", nargs="*", default=None, help="sweep just these shapes")
    parser.add_argument("--sweep", action="store_true", help="time candidate configs (at --sweep-m)")
    parser.add_argument("--sweep-m", type=int, nargs="+", default=None,
                        help="token counts M of the sweep (default: the benchmark's M values)")
    parser.add_argument("--sweep-ops", nargs="*", default=["linear_fwd", "linear_dx", "linear_dw"],
                        help="sweep just these ops")
    parser.add_argument("--sweep-only-run", action="store_true",
                        help="skip the checks and the frozen-config cases (a sweep run alone)")
    parser.add_argument("--sweep-candidates", type=int, nargs="*", default=None,
                        help="time just these candidate indices (0: the frozen config, 1: it walking whole tiles, "
                             "2: it with STREAM_K)")
    parser.add_argument("--variant", nargs="+", default=None, metavar="BLOCK=VALUE",
                        help="--variant-ops with these blocks set in the frozen configs (e.g. STREAM_K=1) "
                             "against the frozen ones (same bits, checked) and against cuBLAS, at --sweep-m or the "
                             "default M")
    parser.add_argument("--variant-ops", nargs="+", default=["linear_fwd", "linear_dx"],
                        choices=["linear_fwd", "linear_dx", "linear_dw"], help="the products --variant times")
    parser.add_argument("--beside", action="store_true",
                        help="time dW beside dX (linear_dx_dw) against the two one by one (at --sweep-m)")
    parser.add_argument("--commit", default=None, help="commit to record when the tree has no .git")
    parser.add_argument("--budget-s", type=float, default=200.0, help="stop timing new cases after this")


def _operands(m, n, k, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, k, device=device, generator=g).to(BF16)
    w = (torch.randn(n, k, device=device, generator=g) / k**0.5).to(BF16)
    dy = torch.randn(m, n, device=device, generator=g).to(BF16)
    return x, w, dy


def _eq(a, b) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def _checks(device, shapes, m) -> dict:
    """Invariance, repeatability, unit fold and accuracy on the GPU."""
    out = {}
    for group in (_check_groups, _check_autograd):
        try:
            group(out, device, shapes, m)
        except Exception as exc:  # keep the checks that ran
            out[f"error_{group.__name__}"] = f"{type(exc).__name__}: {exc}"[:2000]
    errors = any(key.startswith("error") for key in out)
    out["all_bitwise_ok"] = not errors and all(v for v in out.values() if isinstance(v, bool))
    return out


def _grad_errors(fn, x, w, b, dy):
    """Max |error| vs float64 of (out, dx, dw, db) through autograd."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, w, b)]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, dy.to(out.dtype))
    gold_leaves = [t.detach().double().requires_grad_(True) for t in (x, w, b)]
    gold = gold_leaves[0] @ gold_leaves[1].T + gold_leaves[2]
    gold_grads = torch.autograd.grad(gold, gold_leaves, dy.double())
    return [(a.double() - g).abs().max().item() for a, g in zip((out, *grads), (gold, *gold_grads))]


def _check_autograd(out, device, shapes, m) -> None:
    """Public linear with bias through autograd (dX, dW, dBias kernels) in bf16, bf16->fp32 output
    and fp32, each against float64 next to the same computation by cuBLAS; zero-row shards."""
    rows = min(m, 1000)
    n, k = shapes["fc2"][0], shapes["qkv"][1] // 2
    g = torch.Generator(device=device).manual_seed(5)
    x = torch.randn(rows, k, device=device, generator=g)
    w = torch.randn(n, k, device=device, generator=g) / k**0.5
    b = torch.randn(n, device=device, generator=g)
    dy = torch.randn(rows, n, device=device, generator=g)
    xb, wb, bb = x.to(BF16), w.to(BF16), b.to(BF16)
    out["autograd_bf16_err_flowlock"] = _grad_errors(linear, xb, wb, bb, dy)
    out["autograd_bf16_err_cublas"] = _grad_errors(F.linear, xb, wb, bb, dy)
    out["autograd_bf16_to_fp32_err_flowlock"] = _grad_errors(
        lambda *a: linear(*a, out_dtype=torch.float32), xb, wb, bb, dy)
    out["autograd_bf16_to_fp32_err_cublas"] = _grad_errors(
        lambda xx, ww, bbb: F.linear(xx.float(), ww.float(), bbb.float()), xb, wb, bb, dy)
    xf, wf = x[:, :96].contiguous(), w[:, :96].contiguous()
    out["autograd_fp32_err_flowlock"] = _grad_errors(linear, xf, wf, b, dy)
    out["autograd_fp32_err_cublas_no_tf32"] = _grad_errors(F.linear, xf, wf, b, dy)
    empty = xb[:0].clone().requires_grad_(True)
    wr = wb.clone().requires_grad_(True)
    y0 = linear(empty, wr, bb)
    (dw0,) = torch.autograd.grad(y0, (wr,), torch.zeros_like(y0))
    out["zero_rows_ok"] = y0.shape == (0, n) and not bool(dw0.any())


def _check_groups(out, device, shapes, m) -> None:
    x, w, dy = _operands(m, *shapes["qkv"], device)
    third = shapes["qkv"][0] // 3
    y = linear(x, w)
    out["fwd_repeatable"] = all(_eq(linear(x, w), y) for _ in range(3))
    out["fwd_row_alone_vs_batch"] = all(_eq(linear(x[r:r + 1], w), y[r:r + 1]) for r in (0, m // 3, m - 1))
    out["fwd_slice_vs_batch"] = _eq(linear(x[m // 40:m - m // 5], w), y[m // 40:m - m // 5])
    q, k, v = (w[i * third:(i + 1) * third].contiguous() for i in range(3))
    out["fused_qkv_equals_separate"] = _eq(torch.cat([linear(x, p) for p in (q, k, v)], dim=1), y)
    dx = lt.linear_dx(dy, w, BF16)
    out["dx_repeatable"] = all(_eq(lt.linear_dx(dy, w, BF16), dx) for _ in range(3))
    out["dx_rows_vs_batch"] = _eq(lt.linear_dx(dy[7:m // 3].contiguous(), w, BF16), dx[7:m // 3])
    dw = lt.linear_dw(dy, x, w, torch.float32)
    out["dw_repeatable"] = all(torch.equal(lt.linear_dw(dy, x, w, torch.float32), dw) for _ in range(3))
    unit = launch_config("linear_dw", BF16, arch_of(w), tuple(w.shape))["UNIT"]
    folded = torch.zeros_like(dw)
    for s in range(0, m, unit):
        folded = folded + lt.linear_dw(dy[s:s + unit].contiguous(), x[s:s + unit].contiguous(), w, torch.float32)
    out["dw_equals_unit_fold"] = torch.equal(folded, dw)
    gold = x.double() @ w.double().T
    scale = gold.abs().max().item()
    out["fwd_max_abs_err"] = (y.double() - gold).abs().max().item()
    out["cublas_fwd_max_abs_err"] = (F.linear(x, w).double() - gold).abs().max().item()
    out["fwd_golden_scale"] = scale
    gold_dw = dy.double().T @ x.double()
    out["dw_max_abs_err"] = (lt.linear_dw(dy, x, w, BF16).double() - gold_dw).abs().max().item()
    out["cublas_dw_max_abs_err"] = (torch.mm(dy.T, x).double() - gold_dw).abs().max().item()
    del gold, gold_dw
    x1, w1, _ = _operands(m, *shapes["fc1"], device, seed=1)
    y1 = linear(x1, w1)
    half = shapes["fc1"][0] // 2
    swapped = torch.cat([w1[half:], w1[:half]]).contiguous()
    out["fc1_swapped_halves_permute"] = _eq(linear(x1, swapped), torch.cat([y1[:, half:], y1[:, :half]], 1))
    xf = torch.randn(m, 96, device=device)
    wf = torch.randn(shapes["fc2"][0], 96, device=device) / 96**0.5
    gf = xf.double() @ wf.double().T
    out["fp32_proj_in_rel_err"] = (linear(xf, wf).double() - gf).abs().max().item() / gf.abs().max().item()


def _time_case(shape, m, device, iters, warmup) -> dict:
    n, k = shape
    x, w, dy = _operands(m, n, k, device)
    flops = 2.0 * m * n * k
    rows = {}
    pairs = {
        "fwd": (lambda _: linear(x, w), lambda _: F.linear(x, w)),
        "dx": (lambda _: lt.linear_dx(dy, w, BF16), lambda _: torch.mm(dy, w)),
        "dw": (lambda _: lt.linear_dw(dy, x, w, BF16), lambda _: torch.mm(dy.T, x)),
    }
    for op, (fa, fb) in pairs.items():
        # idle: single calls from an idle device (host launch time counts); queued: behind a GPU spin,
        # the kernels' own rate as in a training step where the host runs ahead
        r = harness.time_pair(fa, fb, device=device, iters=iters, warmup=warmup)
        rq = harness.time_pair(fa, fb, device=device, iters=iters, warmup=1, queued=True)
        rows[op] = {"flowlock_ms": r["a"]["median_ms"], "cublas_ms": r["b"]["median_ms"],
                    "flowlock_tflops": flops / r["a"]["median_ms"] / 1e9,
                    "cublas_tflops": flops / r["b"]["median_ms"] / 1e9,
                    "ratio_of_cublas_throughput": r["b"]["median_ms"] / r["a"]["median_ms"],
                    "flowlock_ms_queued": rq["a"]["median_ms"], "cublas_ms_queued": rq["b"]["median_ms"],
                    "ratio_of_cublas_throughput_queued": rq["b"]["median_ms"] / rq["a"]["median_ms"]}
    return rows


def _candidates(op: str, base: LaunchConfig) -> list[LaunchConfig]:
    """The frozen config first, then variants with the same BLOCK_R and UNIT (so the same bits)."""
    def mk(warps, stages, **blocks):
        return dataclasses.replace(base.with_blocks(**blocks), num_warps=warps, num_stages=stages)

    if op == "linear_dw":
        return [base, mk(base.num_warps, base.num_stages, TAIL_SPLIT=0),
                mk(8, 4, BLOCK_I=128, BLOCK_J=128, EPI_SPLIT=0, FLAT_UNITS=1),
                mk(8, 4, BLOCK_I=128, BLOCK_J=128, EPI_SPLIT=0, FLAT_UNITS=1, FLATTEN=1),
                mk(8, 3, BLOCK_I=128, BLOCK_J=256, EPI_SPLIT=0, FLAT_UNITS=0, FLATTEN=0),
                mk(8, 3, BLOCK_I=128, BLOCK_J=256, EPI_SPLIT=1, FLAT_UNITS=1, FLATTEN=1)]
    # then smaller tiles (more, shorter waves: N = 5376 at M = 4096 leaves a 0.18 last wave of 128x128
    # tiles), deeper pipelines and other tile-group heights (none beat 128x128 there in the sweep of
    # 49d5e61, which also tried two persistent programs per SM)
    return [base, mk(base.num_warps, base.num_stages, TAIL_SPLIT=0),
            mk(base.num_warps, base.num_stages, STREAM_K=1),
            mk(8, 3, BLOCK_I=128, BLOCK_J=256, EPI_SPLIT=1, FLATTEN=1),
            mk(8, 3, BLOCK_I=128, BLOCK_J=256, EPI_SPLIT=1, FLATTEN=0),
            mk(8, 4, BLOCK_I=128, BLOCK_J=128, EPI_SPLIT=0, FLATTEN=0),
            mk(8, 4, BLOCK_I=128, BLOCK_J=128, EPI_SPLIT=0, FLATTEN=1),
            mk(8, 3, BLOCK_I=256, BLOCK_J=128, EPI_SPLIT=1, FLATTEN=1),
            mk(4, 4, BLOCK_I=128, BLOCK_J=64, EPI_SPLIT=0, FLATTEN=1),
            mk(4, 4, BLOCK_I=64, BLOCK_J=128, EPI_SPLIT=0, FLATTEN=1),
            mk(8, 5, BLOCK_I=128, BLOCK_J=128, EPI_SPLIT=1, FLATTEN=1),
            mk(8, 4, BLOCK_I=128, BLOCK_J=128, EPI_SPLIT=0, FLATTEN=1, GROUP_I=16),
            mk(8, 4, BLOCK_I=128, BLOCK_J=128, EPI_SPLIT=0, FLATTEN=1, GROUP_I=4)]


def _sweep(device, shapes, ms, t_end, ops, chosen=None) -> list[dict]:
    """Each candidate config (or those at the indices ``chosen``) against cuBLAS, per shape and M."""
    results = []
    for m in ms:
        for name, (n, k) in shapes.items():
            x, w, dy = _operands(m, n, k, device)
            flops = 2.0 * m * n * k
            runners = {
                "linear_fwd": (lambda c, x=x, w=w: lt.linear_fwd(x, w, None, BF16, config=c),
                               lambda _, x=x, w=w: F.linear(x, w)),
                "linear_dx": (lambda c, dy=dy, w=w: lt.linear_dx(dy, w, BF16, config=c),
                              lambda _, dy=dy, w=w: torch.mm(dy, w)),
                "linear_dw": (lambda c, dy=dy, x=x, w=w: lt.linear_dw(dy, x, w, BF16, config=c),
                              lambda _, dy=dy, x=x: torch.mm(dy.T, x)),
            }
            for op, (run, cublas) in runners.items():
                if op not in ops:
                    continue
                base = launch_config(op, BF16, arch_of(w), (n, k))
                ref = None
                candidates = _candidates(op, base)
                for idx, cand in enumerate(candidates):
                    if (chosen is not None and idx not in chosen) or cand in candidates[:idx]:
                        continue
                    if time.perf_counter() > t_end:
                        return results
                    row = {"shape": name, "m": m, "op": op, "candidate": idx, "blocks": dict(cand.blocks),
                           "warps": cand.num_warps, "stages": cand.num_stages}
                    try:
                        got = run(cand)
                        ref = got if ref is None else ref
                        row["same_bits_as_first"] = _eq(got, ref)
                        r = harness.time_pair(lambda _, c=cand, f=run: f(c), cublas, device=device, iters=20,
                                              warmup=2)
                        row["tflops"] = flops / r["a"]["median_ms"] / 1e9
                        row["ratio_of_cublas_throughput"] = r["b"]["median_ms"] / r["a"]["median_ms"]
                    except Exception as exc:  # a candidate that fails to compile is a result, not a crash
                        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                    results.append(row)
                    print(name, m, op, idx, row.get("ratio_of_cublas_throughput"), row.get("same_bits_as_first"),
                          row.get("error", ""), flush=True)
    return results


def _beside(device, shapes, ms, t_end) -> list[dict]:
    """dX and dW of one layer: ``linear_dx_dw`` (dW on a side stream, one program per tile) against
    dX then dW on one stream with dW's persistent walk; same bits (checked), times idle and queued."""
    results = []
    for m in ms:
        for name, (n, k) in shapes.items():
            if time.perf_counter() > t_end:
                return results
            x, w, dy = _operands(m, n, k, device)
            cfg = launch_config("linear_dw", BF16, arch_of(w), (n, k))
            serial_cfg = cfg.with_blocks(PER_TILE=0)
            beside = lambda _, x=x, w=w, dy=dy: lt.linear_dx_dw(dy, x, w, BF16, BF16)
            serial = lambda _, x=x, w=w, dy=dy, c=serial_cfg: (lt.linear_dx(dy, w, BF16),
                                                                 lt.linear_dw(dy, x, w, BF16, config=c))
            got, want = beside(None), serial(None)
            row = {"shape": name, "m": m, "same_bits": _eq(got[0], want[0]) and _eq(got[1], want[1])}
            for mode, queued in (("idle", False), ("queued", True)):
                r = harness.time_pair(beside, serial, device=device, iters=20, warmup=2, queued=queued)
                row[mode] = {"beside_ms": r["a"]["median_ms"], "serial_ms": r["b"]["median_ms"],
                             "beside_over_serial": r["ratio_a_over_b"]}
            results.append(row)
            print(name, m, row, flush=True)
    return results


def _variant(device, shapes, ms, t_end, blocks: dict[str, int], ops=("linear_fwd", "linear_dx")) -> list[dict]:
    """``ops`` (forward, dX, dW) of each layer with the frozen config's ``blocks`` set (a schedule or
    kernel that moves no bits: STREAM_K=1, TAIL_SPLIT=0, GLUON=1) against the frozen config and against
    cuBLAS; same bits checked; queued (the GPU's rate) and idle (host launch time counts)."""
    results = []
    for m in ms:
        for name, (n, k) in shapes.items():
            x, w, dy = _operands(m, n, k, device)
            for op, run, cublas in (
                    ("linear_fwd", lambda c, x=x, w=w: lt.linear_fwd(x, w, None, BF16, config=c),
                     lambda _, x=x, w=w: F.linear(x, w)),
                    ("linear_dx", lambda c, dy=dy, w=w: lt.linear_dx(dy, w, BF16, config=c),
                     lambda _, dy=dy, w=w: torch.mm(dy, w)),
                    ("linear_dw", lambda c, dy=dy, x=x, w=w: lt.linear_dw(dy, x, w, BF16, config=c),
                     lambda _, dy=dy, x=x: torch.mm(dy.T, x))):
                if op not in ops:
                    continue
                if time.perf_counter() > t_end:
                    return results
                frozen = launch_config(op, BF16, arch_of(w), (n, k))
                cfg = frozen.with_blocks(**blocks)
                rows, cols = {"linear_fwd": (m, n), "linear_dx": (m, k), "linear_dw": (n, k)}[op]
                tiles = -(-rows // cfg["BLOCK_I"]) * -(-cols // cfg["BLOCK_J"])
                sms = lt._num_programs(device.index or 0) if device.type == "cuda" else lt._INTERP_PROGRAMS
                row = {"shape": name, "m": m, "op": op, "tiles": tiles, "variant": blocks,
                       "stream_k": lt.streams_k(bool(dict(cfg.blocks).get("STREAM_K", 0)), cfg["UNIT"], False, tiles,
                                                sms),
                       "same_bits": _eq(run(cfg), run(frozen))}
                for mode, queued in (("idle", False), ("queued", True)):
                    r = harness.time_pair(lambda _, c=cfg, f=run: f(c), lambda _, c=frozen, f=run: f(c),
                                          device=device, iters=20, warmup=2, queued=queued)
                    row[mode] = {"variant_ms": r["a"]["median_ms"], "frozen_ms": r["b"]["median_ms"],
                                 "variant_over_frozen": r["ratio_a_over_b"]}
                r = harness.time_pair(lambda _, c=cfg, f=run: f(c), cublas, device=device, iters=20, warmup=2,
                                      queued=True)
                row["queued"]["cublas_ms"] = r["b"]["median_ms"]
                row["queued"]["ratio_of_cublas_throughput"] = r["b"]["median_ms"] / r["a"]["median_ms"]
                r = harness.time_pair(lambda _, c=frozen, f=run: f(c), cublas, device=device, iters=20, warmup=2,
                                      queued=True)
                row["queued"]["frozen_ratio_of_cublas_throughput"] = r["b"]["median_ms"] / r["a"]["median_ms"]
                results.append(row)
                print(name, m, op, row, flush=True)
    return results


def _section(payload, key, fn, out_path):
    """Run one part of the benchmark; a failure is recorded (and the JSON written) rather than lost."""
    try:
        payload[key] = fn()
    except Exception as exc:  # keep what was measured so far when a kernel fails to compile on the GPU
        payload.setdefault("errors", {})[key] = f"{type(exc).__name__}: {exc}"[:2000]
        print(f"{key} failed: {exc}", flush=True)
    harness.write_json(out_path, payload)


def main(argv=None) -> None:
    args = harness.parse_args(__doc__.splitlines()[0], argv, _extra)
    gate = harness.gate_or_exit(args, ["tests/ops/test_linear.py"])
    device = torch.device(args.device)
    if args.smoke:
        device = torch.device("cpu")
    elif device.type != "cuda":
        raise SystemExit("bench_linear needs a CUDA device (or --smoke under TRITON_INTERPRET=1)")
    shapes, ms = (SMOKE_SHAPES, SMOKE_MS) if args.smoke else (SHAPES, MS)
    torch.backends.cuda.matmul.allow_tf32 = False
    t_end = time.perf_counter() + args.budget_s
    env = harness.environment(device)
    payload = {"benchmark": "linear", "environment": env, "commit": env["git_commit"] or args.commit,
               "gate": gate, "configs": {}, "checks": None, "cases": [], "sweep": []}
    for op in ("linear_fwd", "linear_dx", "linear_dw"):
        for name, shape in shapes.items():
            c = launch_config(op, BF16, arch_of(torch.empty(0, device=device)), shape)
            payload["configs"][f"{op}/{name}"] = {"blocks": dict(c.blocks), "warps": c.num_warps,
                                                  "stages": c.num_stages, "note": c.note}
    with flowlock.use_backend("triton"):
        if not args.sweep_only_run:
            _section(payload, "checks", lambda: _checks(device, shapes, ms[0]), args.out)
            print(payload["checks"], flush=True)

        def cases():
            rows = []
            for m in ms:
                for name, shape in shapes.items():
                    if time.perf_counter() > t_end:
                        payload["truncated"] = True
                        return rows
                    row = {"shape": name, "m": m, "n": shape[0], "k": shape[1],
                           **_time_case(shape, m, device, args.iters, args.warmup)}
                    rows.append(row)
                    payload["cases"] = rows
                    print({key: ((round(v["ratio_of_cublas_throughput"], 3),
                                  round(v["ratio_of_cublas_throughput_queued"], 3)) if isinstance(v, dict) else v)
                           for key, v in row.items()}, flush=True)
            return rows

        if not args.sweep_only_run:
            _section(payload, "cases", cases, args.out)
        if args.variant:
            blocks = {k: int(v) for k, v in (item.split("=") for item in args.variant)}
            variant_shapes = shapes if args.smoke else BESIDE_SHAPES
            _section(payload, "variant",
                     lambda: _variant(device, variant_shapes, args.sweep_m or ms, t_end, blocks, args.variant_ops),
                     args.out)
        if args.beside:
            beside_shapes = shapes if args.smoke else BESIDE_SHAPES
            _section(payload, "beside", lambda: _beside(device, beside_shapes, args.sweep_m or ms, t_end), args.out)
        if args.sweep:
            names = args.sweep_only or (("qkv", "fc2") if args.quick else tuple(shapes))
            sweep_shapes = {k: shapes[k] for k in names}
            _section(payload, "sweep", lambda: _sweep(device, sweep_shapes, args.sweep_m or ms, t_end,
                                                                 args.sweep_ops, args.sweep_candidates), args.out)


if __name__ == "__main__":
    main()
