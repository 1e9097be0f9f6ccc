"""Memory-bound ops of the strict H3 block at H3's widths against a copy of the same bytes.

For each op (the public flowlock op, frozen configs) and phase (forward; backward = autograd of the
op's output with a fixed cotangent into every input that trains in the model) at each token count S,
in one process: the phase's time against ``dst.copy_(src)`` moving the same number of bytes,
alternating, both queued behind a GPU spin (the GPU's rate, not the host's). ``bytes`` is the least
traffic the phase needs: every activation-sized input read once and every activation-sized output
written once (rope tables counted; weights, (3, H) tables, indices and fp32 partials are under 0.1%
and not). ``of_copy`` = copy time / phase time: 1.0 moves the bytes as fast as a copy; 0.25 takes
four times as long. It says which kernels are worth work and how much each can give back.

H3 widths: hidden 5376, 56 heads of 128 with 96 rope channels, SwiGLU 14336; rows of one packed
sample in ``bench_model``'s proportions (text 256, audio S // 16, the rest video), each row's
modulation row its modality (three table rows).

Run: ``PYTHONPATH=src python benchmarks/bench_memory_bound.py --out benchmarks/results/memory_bound.json``
(``--seq`` picks S; ``--kernels`` adds each phase's GPU time per kernel from the profiler; ``--smoke``:
tiny widths on CPU under TRITON_INTERPRET=1, where it checks the script and measures nothing).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import harness
import torch

import flowlock
from flowlock.config import config_for
from flowlock.ops import gate_residual, qk_norm_rope, rms_norm_modulate, segment_sum, swiglu
from flowlock.ops.rms_norm import triton as rms_norm_triton
from flowlock.testing import bitwise_equal

BF16 = torch.bfloat16


class Widths(NamedTuple):
    hidden: int
    heads: int
    head_dim: int
    rope: int
    ffn: int


H3 = Widths(hidden=5376, heads=56, head_dim=128, rope=96, ffn=14336)
SMOKE = Widths(hidden=32, heads=2, head_dim=16, rope=12, ffn=24)
SEQS = (925, 4253, 16384)
SMOKE_SEQS = (40,)


class Phase(NamedTuple):
    """One timed call and the bytes it must move."""

    run: Callable[[], object]
    bytes: int


def _modality_index(s: int, device: torch.device) -> torch.Tensor:
    """Each row's table row: 0 for video, then 1 for audio (S // 16 rows), then 2 for text (256 rows,
    a quarter of S at smoke sizes)."""
    text = min(256, s // 4)
    audio = s // 16
    index = torch.zeros(s, dtype=torch.int64, device=device)
    index[s - text - audio:s - text] = 1
    index[s - text:] = 2
    return index


def _phases(fn: Callable[..., torch.Tensor], leaves: list[torch.Tensor], rest: list, fwd_bytes: int,
            bwd_bytes: int, gen: torch.Generator) -> dict[str, Phase]:
    """Forward (a new autograd node each call) and backward (one graph, kept) of ``fn(*leaves, *rest)``."""
    out = fn(*leaves, *rest)
    cot = torch.randn(out.shape, generator=gen, device=out.device).to(out.dtype)
    return {"forward": Phase(lambda: fn(*leaves, *rest), fwd_bytes),
            "backward": Phase(lambda: torch.autograd.grad(out, leaves, cot, retain_graph=True), bwd_bytes)}


def cases(s: int, w: Widths, device: torch.device, seed: int = 0) -> dict[str, dict[str, Phase]]:
    """Every op's phases at ``s`` rows of widths ``w``."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape, dtype=BF16, grad=True):
        t = torch.randn(shape, generator=gen, device=device).to(dtype)
        return t.requires_grad_(grad)

    h, inner, act = w.hidden, w.heads * w.head_dim, 2  # act: bytes per bf16 element
    index = _modality_index(s, device)
    cos, sin = (rand(s, w.rope, dtype=torch.float32, grad=False) for _ in range(2))
    table = 2 * s * w.rope * 4
    values = rand(s, h, grad=False)
    return {
        "rms_norm_modulate": _phases(rms_norm_modulate, [rand(s, h), rand(h), rand(3, h), rand(3, h)],
                                     [index, 1e-6], 2 * s * h * act, 3 * s * h * act, gen),
        "qk_norm_rope": _phases(lambda x, wt: qk_norm_rope(x, wt, cos, sin, 1e-6),
                                [rand(1, s, w.heads, w.head_dim), rand(w.head_dim)], [],
                                2 * s * inner * act + table, 3 * s * inner * act + table, gen),
        "gate_residual": _phases(gate_residual, [rand(s, h), rand(3, h), rand(s, h)], [index],
                                 3 * s * h * act, 3 * s * h * act, gen),
        "swiglu": _phases(swiglu, [rand(s, 2 * w.ffn)], [], 3 * s * w.ffn * act, 5 * s * w.ffn * act, gen),
        "segment_sum": {"forward": Phase(lambda: segment_sum(values, index, 3), s * h * act)},
    }


def _copy(nbytes: int, device: torch.device) -> Callable[[], object]:
    """A device copy that reads and writes ``nbytes`` in all (half each way)."""
    src = torch.empty(max(1, nbytes // 4), dtype=BF16, device=device)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def measure(phase: Phase, device: torch.device, iters: int, warmup: int) -> dict:
    copy = _copy(phase.bytes, device)
    timed = harness.time_pair(lambda _: phase.run(), lambda _: copy(), device=device, iters=iters, warmup=warmup,
                              queued=device.type == "cuda")
    op_ms, copy_ms = timed["a"]["median_ms"], timed["b"]["median_ms"]
    return {"bytes": phase.bytes, "ms": op_ms, "p20_ms": timed["a"]["p20_ms"], "p80_ms": timed["a"]["p80_ms"],
            "copy_ms": copy_ms, "of_copy": copy_ms / op_ms, "gb_per_s": phase.bytes / op_ms / 1e6}


# Calls of a phase under the profiler for --kernels; each kernel's time is their mean.
PROFILED_CALLS = 5


def kernels(phase: Phase, device: torch.device) -> list[dict]:
    """The phase's GPU time per kernel (``harness.kernel_times``), per call: which of an op's launches
    the time above the copy's is in."""
    per_run = harness.kernel_times(lambda: [phase.run() for _ in range(PROFILED_CALLS)], device)
    return [{"kernel": k["kernel"], "ms": k["ms"] / PROFILED_CALLS} for k in per_run]


def norm_dw_blocks(s: int, w: Widths, device: torch.device, blocks: list[int], iters: int, warmup: int,
                   seed: int = 0) -> list[dict]:
    """rms_norm_modulate's backward with the dweight launch's BLOCK_C replaced by each of ``blocks``
    against the frozen config: same bits (dx and the three gradients, checked) and queued time."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x, dy = (torch.randn(s, w.hidden, generator=gen, device=device).to(BF16) for _ in range(2))
    weight = torch.randn(w.hidden, generator=gen, device=device).to(BF16)
    shift, scale = (torch.randn(3, w.hidden, generator=gen, device=device).to(BF16) for _ in range(2))
    index = _modality_index(s, device)
    _, rstd = rms_norm_triton.rms_norm_fwd(x, weight, 1e-6, shift, scale, index)
    frozen = config_for("rms_norm_bwd", x)

    def run(cfg):
        return rms_norm_triton.rms_norm_bwd(dy, x, weight, rstd, shift, scale, index, config=cfg)

    want = run(frozen)
    rows = []
    for block_c in blocks:
        cfg = frozen.with_blocks(BLOCK_C=block_c)
        got = run(cfg)
        timed = harness.time_pair(lambda _, c=cfg: run(c), lambda _: run(frozen), device=device, iters=iters,
                                  warmup=warmup, queued=device.type == "cuda")
        rows.append({"S": s, "BLOCK_C": block_c, "frozen_BLOCK_C": frozen["BLOCK_C"],
                     "same_bits": all(torch.equal(a, b) for a, b in zip(got, want)),
                     "ms": timed["a"]["median_ms"], "frozen_ms": timed["b"]["median_ms"],
                     "over_frozen": timed["ratio_a_over_b"]})
    return rows


def one_segment(s: int, w: Widths, device: torch.device, iters: int, warmup: int, seed: int = 0) -> list[dict]:
    """The three launches that write segment partials (segment_sum's, the gated residual's backward,
    the modulated norm's backward with its table gradients) with the frozen ``segment_sum_partials``
    config (ONE_SEGMENT: a tile of one segment reduces it alone) against the same with ONE_SEGMENT off:
    same bits (checked) and queued time."""
    from flowlock.ops.gate_residual import triton as gate_residual_triton
    from flowlock.ops.segment_sum import triton as segment_sum_triton

    gen = torch.Generator(device=device).manual_seed(seed)
    x, dy, y = (torch.randn(s, w.hidden, generator=gen, device=device).to(BF16) for _ in range(3))
    weight = torch.randn(w.hidden, generator=gen, device=device).to(BF16)
    shift, scale, gate = (torch.randn(3, w.hidden, generator=gen, device=device) for _ in range(3))
    index = _modality_index(s, device)
    _, rstd = rms_norm_triton.rms_norm_fwd(x, weight, 1e-6, shift, scale, index)
    frozen = config_for("segment_sum_partials", x)
    partials = torch.empty((segment_sum_triton.num_tiles(dy), 3 * w.hidden), dtype=torch.float32, device=device)

    def segment_sum_partials(cfg):
        segment_sum_triton.write_segment_partials(partials, dy, index, 3, config=cfg)
        return (partials.clone(),)

    ops = {"segment_sum_partials": segment_sum_partials,
           "gate_residual_backward": lambda cfg: gate_residual_triton.gate_residual_bwd(dy, gate, y, index, cfg),
           "rms_norm_modulate_backward": lambda cfg: rms_norm_triton.rms_norm_bwd(
               dy, x, weight, rstd, shift, scale, index, segment_config=cfg)}
    every = frozen.with_blocks(ONE_SEGMENT=0)
    rows = []
    for name, run in ops.items():
        same = all(bitwise_equal(a, b) for a, b in zip(run(frozen), run(every)))
        timed = harness.time_pair(lambda _, f=run: f(frozen), lambda _, f=run: f(every), device=device, iters=iters,
                                  warmup=warmup, queued=device.type == "cuda")
        rows.append({"S": s, "op": name, "same_bits": same, "one_segment_ms": timed["a"]["median_ms"],
                     "every_segment_ms": timed["b"]["median_ms"], "one_over_every": timed["ratio_a_over_b"]})
    return rows


def _extra(parser):
    parser.add_argument("--seq", type=int, nargs="*", default=None, help=f"token counts S (default {SEQS})")
    parser.add_argument("--norm-dw-blocks", type=int, nargs="*", default=None,
                        help="also time rms_norm_modulate's backward with these dweight BLOCK_C against the frozen "
                             "config (same bits checked)")
    parser.add_argument("--one-segment", action="store_true",
                        help="also time the segment-partial launches with ONE_SEGMENT against without (same bits "
                             "checked)")
    parser.add_argument("--kernels", action="store_true",
                        help=f"also profile {PROFILED_CALLS} calls of each phase: GPU time per kernel")


def main(argv=None) -> int:
    args = harness.parse_args(__doc__.splitlines()[0], argv, _extra)
    gate = harness.gate_or_exit(args, ["tests/ops/test_rms_norm.py", "tests/ops/test_qk_norm_rope.py",
                                       "tests/ops/test_gate_residual.py", "tests/ops/test_swiglu.py",
                                       "tests/ops/test_segment_sum.py"])
    device = torch.device("cpu" if args.smoke else args.device)
    if device.type != "cuda" and not args.smoke:
        raise SystemExit("bench_memory_bound needs a CUDA device (or --smoke under TRITON_INTERPRET=1)")
    widths, seqs = (SMOKE, SMOKE_SEQS) if args.smoke else (H3, tuple(args.seq or SEQS))
    payload = {"benchmark": "memory_bound", "smoke": args.smoke, "environment": harness.environment(device),
               "gate": gate, "settings": {"seqs": list(seqs), "widths": widths._asdict(), "iters": args.iters,
                                          "warmup": args.warmup, "queued": device.type == "cuda"}, "rows": []}
    with flowlock.use_backend("triton"):
        for s in seqs:
            for op, phases in cases(s, widths, device).items():
                for name, phase in phases.items():
                    row = {"S": s, "op": op, "phase": name, **measure(phase, device, args.iters, args.warmup)}
                    if args.kernels:
                        row["kernels"] = kernels(phase, device)
                    payload["rows"].append(row)
                    print(row, flush=True)
                    harness.write_json(args.out, payload)
            if args.norm_dw_blocks:
                rows = norm_dw_blocks(s, widths, device, args.norm_dw_blocks, args.iters, args.warmup)
                payload.setdefault("norm_dw_blocks", []).extend(rows)
                print(rows, flush=True)
                harness.write_json(args.out, payload)
            if args.one_segment:
                rows = one_segment(s, widths, device, args.iters, args.warmup)
                payload.setdefault("one_segment", []).extend(rows)
                print(rows, flush=True)
                harness.write_json(args.out, payload)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    harness.write_json(args.out, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
