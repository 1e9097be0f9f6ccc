"""Issue 12 evidence: the full-depth H3 training step and forward, strict vs stock diffusers, eager and compiled.

The model: diffusers' ``MiniMaxH3Transformer3DModel`` at full depth and width (50 blocks + 2
refiner blocks, 33.1B parameters; ``--layers N`` for fewer blocks) with random weights, built on
the GPU directly in BF16 with the FP32 modules kept FP32, gradient checkpointing on, every
parameter trained. Batch 1; text 256 rows, audio S // 16 rows, the rest video.

Measured per S (default {925, 4253, 8349, 16384}) and measure:

* ``forward``: one forward under ``no_grad``;
* ``step``: one training step, forward + backward of a fixed random cotangent loss into every
  parameter's gradient (set to ``None`` before each step, untimed). No optimizer: its FP32 state
  would not fit beside 33B parameters and their gradients on one GPU, and it is not what differs.

Four plain variants of the one model instance (two copies would not fit on one GPU): ``strict_eager``
(``flowlock.patch``), ``strict_compiled`` (the same plus diffusers' regional compile,
``compile_repeated_blocks``), ``stock_eager`` (the patch detached: stock diffusers) and
``stock_compiled`` (stock diffusers with the same regional compile). Same process; every variant is
called once first (compilation and kernel builds, timed as ``first_call_s``), then
``harness.time_rounds``: warm-up rounds, then ``--iters`` rounds of one call per variant with the
first variant rotating, CUDA events; median, min and max. Peak allocated memory per variant over
its timed calls. At S in ``--breakdown-seq`` (default 925 and 16384) one profiled step per variant
gives the GPU time per kernel group (``torch.profiler``) and one more its host time per Python function
(``cProfile``, ``harness.host_profile``): where a step's wall time exceeds its GPU time. A variant that
raises (a compile error, out of memory) is recorded with its error and left out of the rest of that S.

Three more variants replay one CUDA graph of the call for the fixed layout
(``flowlock.models.minimax_h3.graphed.capture_h3``: one warm-up call, capture, then each timed call
copies fresh latents and timesteps in, validates them and replays): ``strict_graphed`` (strict eager
captured), ``stock_graphed`` and ``stock_compiled_graphed``. A captured step owns its gradients, and
two gradient sets do not fit beside a 33B model, so each graphed variant is captured, timed
(``--warmup`` then ``--iters`` replays) and released on its own after the alternating rounds of the
four others: graphed variants are not interleaved with the rest. A path that cannot be captured is
recorded with its error.

Run: ``python benchmarks/bench_model.py --out benchmarks/results/model.json [--seq 925 4253]
[--measures forward,step] [--variants strict_eager,stock_compiled]``; ``--smoke`` runs the tiny H3
on CPU to check the script; ``--merge A.json B.json --out C.json`` joins the rows of runs of one
commit on one GPU (one device call each). A PNG next to the JSON is drawn by ``plot.py``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import bench_block
import harness
import torch

import flowlock

GATE_TESTS = ("tests/models",)
FULL_SEQ = (925, 4253, 8349, 16384)
BREAKDOWN_SEQ = (925, 16384)
SMOKE_SEQ = (24, 40)
TEXT_ROWS, SMOKE_TEXT_ROWS = 256, 4
FULL_LAYERS, REFINER_LAYERS = 50, 2
MEASURES = ("forward", "step")
# variant -> (path, compiled, graphed)
VARIANTS = {"strict_eager": ("strict", False, False), "strict_compiled": ("strict", True, False),
            "stock_eager": ("stock", False, False), "stock_compiled": ("stock", True, False),
            "strict_graphed": ("strict", False, True), "stock_graphed": ("stock", False, True),
            "stock_compiled_graphed": ("stock", True, True)}
PLAIN_VARIANTS = tuple(v for v, (_, _, graphed) in VARIANTS.items() if not graphed)
GRAPHED_VARIANTS = tuple(v for v, (_, _, graphed) in VARIANTS.items() if graphed)
# First calls run stock before strict, so that the stock graphs are compiled before a strict compile
# can fill dynamo's recompile limit (both share the code object of nn.Module._call_impl).
FIRST_CALL_ORDER = ("stock_eager", "stock_compiled", "strict_eager", "strict_compiled")
# Per S the run compiles, on that shared code object, 2 block classes x 2 paths x (no_grad, grad):
# 8 graphs (a CPU smoke run counts 4 for stock; the checkpoint recomputation reuses the grad graph),
# exactly dynamo's default limit of 8, which leaves no margin.
RECOMPILE_LIMIT = 16
TOP_KERNELS = 25
# Kernel-name fragments of each group, tested in this order (cuDNN and FlashAttention names also
# carry GEMM-like fragments such as "sm90").
KERNEL_GROUPS = (("attention", ("attention", "attn", "flash", "fmha", "sdpa", "cudnn")),
                 ("gemm", ("gemm", "linear", "nvjet", "cutlass", "xmma", "cublas", "matmul", "wgrad")),
                 ("copy/fill", ("copy", "memcpy", "memset", "fill", "gather", "scatter")))
# Which forward runs is set by Paths.use (the patch attached or detached), not by a flowlock mode, so
# stock is timed with no flowlock wrapper in its call path at all (provider mode would also give
# stock arithmetic: the patch carries the caller's mode into the CUDA autograd threads'
# gradient-checkpoint recomputation, models/common/patched_forward.py).
MODE = "strict"


def model_packing(seq: int, text_rows: int = TEXT_ROWS):
    """``text_rows`` text rows, ``seq // 16`` audio rows, the rest video on ``t`` square frames
    (the widest side up to 64 that divides the video rows)."""
    from flowlock.models.minimax_h3.packing import build_packing

    audio = seq // 16
    video = seq - text_rows - audio
    side = max(s for s in range(1, 65) if video % (s * s) == 0)
    return build_packing(text_rows, video // (side * side), side, side, audio)


def build_model(config: dict, device: torch.device, seed: int = 0):
    """The random-weight H3 of ``config`` drawn on ``device`` (diffusers' default initialisation)
    in BF16, then its FP32 modules cast to FP32: no FP32 copy of the whole model, none on the host."""
    from diffusers import MiniMaxH3Transformer3DModel

    from flowlock.models.minimax_h3.tiny import FP32_MODULES

    default = torch.get_default_dtype()
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), device:
        torch.manual_seed(seed)
        torch.set_default_dtype(torch.bfloat16)
        try:
            model = MiniMaxH3Transformer3DModel(**config)
        finally:
            torch.set_default_dtype(default)
    for name in FP32_MODULES:
        model.get_submodule(name).float()
    model.train()
    model.enable_gradient_checkpointing()
    return model


class Paths:
    """Switches one patched model between the four variants.

    Stock is the model with the patch's instance-level forwards detached: the patch changes nothing
    else, and the model was built without instance-level forwards. Re-attaching the same function
    objects (not patching anew) keeps the compiled strict graphs' guards valid; compiled is the
    blocks' ``compile_repeated_blocks`` call implementation set or cleared.
    """

    def __init__(self, model, handle, compiled: dict):
        self._patched = [(model.get_submodule(name), attr) for name, attr in handle.patched]
        self._forwards = [module.__dict__[attr] for module, attr in self._patched]
        self._compiled = compiled

    def use(self, variant: str) -> None:
        path, compiled, _ = VARIANTS[variant]
        for (module, attr), fn in zip(self._patched, self._forwards):
            if path == "strict":
                module.__dict__[attr] = fn
            else:
                module.__dict__.pop(attr, None)
        for module, impl in self._compiled.items():
            module._compiled_call_impl = impl if compiled else None


def compile_blocks(model, fullgraph: bool, backend: str, mode: str | None = None) -> dict:
    """diffusers' regional compile (``mode``: torch.compile's, e.g. ``reduce-overhead`` for CUDA graphs);
    returns each compiled block's call implementation."""
    model.compile_repeated_blocks(fullgraph=fullgraph, backend=backend, **({"mode": mode} if mode else {}))
    return {m: m._compiled_call_impl for m in model.modules() if m._compiled_call_impl is not None}


def _forward(model, inputs: dict) -> None:
    with torch.no_grad():
        bench_block._outputs(model, inputs, MODE)


def _call(fn, device: torch.device) -> float:
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def _error(err: Exception) -> str:
    return f"{type(err).__name__}: {err}"


def group_of(kernel: str) -> str:
    """The :data:`KERNEL_GROUPS` group of a kernel name, else ``"other"`` (norms, RoPE, modulation,
    elementwise and reductions)."""
    name = kernel.lower()
    for group, fragments in KERNEL_GROUPS:
        if any(f in name for f in fragments):
            return group
    return "other"


def breakdown(model, inputs: dict, cots, device: torch.device) -> dict:
    """GPU time (ms) of one profiled step: total, per kernel group and the largest kernel-name groups."""
    kernels = bench_block.breakdown(model, inputs, cots, MODE, device, top=sys.maxsize)
    groups: dict[str, float] = {}
    for k in kernels:
        groups[group_of(k["kernel"])] = groups.get(group_of(k["kernel"]), 0.0) + k["ms"]
    return {"total_ms": sum(k["ms"] for k in kernels), "groups_ms": dict(sorted(groups.items(), key=lambda kv: -kv[1])),
            "top": kernels[:TOP_KERNELS]}


class ModelBench:
    """The measurements of one run on one model instance. A variant that raised is recorded and left
    out of the rest of the run: its cause (a compile error, out of memory) recurs at every later,
    longer S, and retrying it would spend the device call's time on the same failure."""

    def __init__(self, model, paths: Paths, config: dict, text_rows: int, args, device: torch.device):
        self.model, self.paths, self.config, self.text_rows = model, paths, config, text_rows
        self.args, self.device = args, device
        self.failed: dict[str, str] = {}

    def _setup(self, variant: str):
        def run():
            self.paths.use(variant)
            self.model.zero_grad(set_to_none=True)
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
        return run

    def _fail(self, variant: str, where: str, message: str) -> None:
        self.failed.setdefault(variant, f"{where}: {message}")

    def rows(self, seq: int, profile: bool) -> list[dict]:
        """One row per measure at ``seq``: first calls, timed rounds, peaks and (``profile``) step
        breakdowns."""
        from flowlock.models.minimax_h3.tiny import tiny_inputs

        model, args, device = self.model, self.args, self.device
        layout = model_packing(seq, self.text_rows)
        inputs = tiny_inputs(1, seed=seq, config=self.config, packing=layout, device=device)
        self.paths.use("stock_eager")
        cots = bench_block.cotangents_for(model, inputs)
        calls = {"forward": lambda: _forward(model, inputs),
                 "step": lambda: bench_block._fwd_bwd(model, inputs, cots, MODE)}
        first: dict[str, dict] = {m: {} for m in args.measures}
        plain = [v for v in args.variants if v in PLAIN_VARIANTS]
        for variant in [v for v in FIRST_CALL_ORDER if v in plain]:
            for m in args.measures:
                if variant in self.failed:
                    break
                self._setup(variant)()
                try:
                    first[m][variant] = _call(calls[m], device)
                except Exception as err:  # recorded: one variant's failure must not end the run
                    self._fail(variant, f"S={seq} {m} first call", _error(err))
        model.zero_grad(set_to_none=True)
        rows = []
        for m in args.measures:
            t0 = time.perf_counter()
            live = [v for v in plain if v not in self.failed]
            peaks: dict[str, int] = {}
            grads: dict[str, int] = {}

            def after(variant, peaks=peaks, grads=grads):
                if device.type == "cuda":
                    peaks[variant] = max(peaks.get(variant, 0), torch.cuda.max_memory_allocated(device))
                grads[variant] = sum(p.grad is not None for p in model.parameters())

            timed = harness.time_rounds({v: (lambda _, f=calls[m]: f()) for v in live}, device=device,
                                        setups={v: self._setup(v) for v in live}, rounds=args.iters,
                                        warmup=args.warmup, after=after)
            for v, r in timed.items():
                if "error" in r:
                    self._fail(v, f"S={seq} {m} timed call", r["error"])
            graphed = [v for v in args.variants if v in GRAPHED_VARIANTS and v not in self.failed]
            replays = {}
            for v in graphed:
                timed[v], replays[v] = self._graphed(v, seq, m, inputs, cots, after, profile)
                first[m][v] = timed[v].pop("capture_s", None)
            per_variant = {}
            for v in args.variants:
                if v in self.failed:
                    per_variant[v] = {"error": self.failed[v]}
                    continue
                r = timed[v]
                per_variant[v] = {"median_s": r["median_ms"] / 1e3, "min_s": r["min_ms"] / 1e3,
                                  "max_s": r["max_ms"] / 1e3, "n": r["n"],
                                  "samples_s": [ms / 1e3 for ms in r["samples_ms"]],
                                  "first_call_s": first[m][v], "warmup_s": [ms / 1e3 for ms in r["warmup_ms"]],
                                  "peak_gib": peaks[v] / 2**30 if v in peaks else None,
                                  "params_with_grad": grads[v]}
            row = make_row(seq, m, layout, per_variant)
            if profile and m == "step":
                profiled = [v for v in plain if v not in self.failed]
                row["breakdown"] = {v: self._breakdown(v, inputs, cots) for v in profiled}
                row["host"] = {v: self._host(v, calls[m]) for v in profiled}
                row["gpu_idle"] = {v: self._idle(v, calls[m]) for v in profiled}
                row["gpu_idle"].update({v: idle for v, idle in replays.items() if idle is not None})
            model.zero_grad(set_to_none=True)
            row["wall_s"] = time.perf_counter() - t0
            rows.append(row)
        return rows

    def _graphed(self, variant: str, seq: int, measure: str, inputs: dict, cots, after,
                 profile: bool) -> tuple[dict, dict | None]:
        """``variant``'s path captured as one CUDA graph (``capture_h3``), then ``--iters`` replays after
        ``--warmup`` ones, each timed as the other variants' calls (inputs copied in, replay); returns
        the timings with ``capture_s`` (warm-up calls and capture) and, at a profiled S of the step, the
        GPU idle time of one replay. The graph and the gradients it owns are released before
        returning: a step's gradient pool does not fit twice beside a 33B model's."""
        from flowlock.models.minimax_h3.graphed import capture_h3

        model, device, args = self.model, self.device, self.args
        self._setup(variant)()
        fn = ((lambda **kw: bench_block._fwd_bwd(model, kw, cots, MODE)) if measure == "step"
              else (lambda **kw: _forward(model, kw)))
        captured = None
        try:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            captured = capture_h3(model, fn, inputs, warmup=1)  # refuses anything but CUDA inputs
            torch.cuda.synchronize(device)
            capture_s = time.perf_counter() - t0
            fresh = {"hidden_states": inputs["hidden_states"].clone(), "timestep": inputs["timestep"].clone()}
            timed = harness.time_rounds({variant: lambda _: captured(**fresh)}, device=device,
                                        setups={variant: lambda: torch.cuda.reset_peak_memory_stats(device)},
                                        rounds=args.iters, warmup=args.warmup, after=after)[variant]
            idle = None
            if measure == "step" and profile and "error" not in timed:
                idle = self._idle(variant, lambda: captured(**fresh))
        except Exception as err:  # recorded: a path that cannot be captured must not end the run
            self._fail(variant, f"S={seq} {measure} capture", _error(err))
            return {"error": self.failed[variant]}, None
        finally:
            if captured is not None:
                captured.release()
            model.zero_grad(set_to_none=True)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if "error" in timed:
            self._fail(variant, f"S={seq} {measure} replay", timed["error"])
            return {"error": self.failed[variant]}, None
        return {**timed, "capture_s": capture_s}, idle

    def _profiled(self, variant: str, profile: Callable[[], dict | None]) -> dict | None:
        """One profiling record of ``variant`` (its path set up first); a profiler failure loses this
        record, not the timed rows."""
        self._setup(variant)()
        try:
            return profile()
        except Exception as err:
            return {"error": _error(err)}

    def _host(self, variant: str, call) -> dict:
        return self._profiled(variant, lambda: harness.host_profile(call, self.device))

    def _idle(self, variant: str, call) -> dict | None:
        return self._profiled(variant, lambda: harness.gpu_idle(call, self.device, name_of=harness.kernel_prefix))

    def _breakdown(self, variant: str, inputs: dict, cots) -> dict:
        return self._profiled(variant, lambda: breakdown(self.model, inputs, cots, self.device))


def make_row(seq: int, measure: str, layout, per_variant: dict) -> dict:
    """One result row: the issue's keys (medians in seconds, ``None`` for a variant not run or
    failed), the ratio of strict's fastest variant to each stock variant and to stock's fastest
    (graphed variants included on both sides), and per-variant detail."""
    s = {v: per_variant.get(v, {}).get("median_s") for v in VARIANTS}
    strict = {v: s[v] for v in VARIANTS if VARIANTS[v][0] == "strict" and s[v] is not None}
    stock = {v: s[v] for v in VARIANTS if VARIANTS[v][0] == "stock" and s[v] is not None}
    best = min(strict, key=strict.get) if strict else None
    best_stock = min(stock, key=stock.get) if stock else None

    def ratio(a, b):
        return a / b if a is not None and b is not None else None

    def peak(path):
        values = [r["peak_gib"] for v, r in per_variant.items() if VARIANTS[v][0] == path and r.get("peak_gib")]
        return max(values) if values else None

    return {"S": seq, "measure": measure, "text_rows": layout.text_indices.numel(),
            "video_rows": layout.video_indices.numel(), "audio_rows": layout.audio_indices.numel(),
            **{f"{v}_s": s[v] for v in VARIANTS},
            "strict_peak_gib": peak("strict"), "stock_peak_gib": peak("stock"),
            "best_strict": best,
            "strict_over_stock_eager": ratio(strict.get(best), s["stock_eager"]),
            "strict_over_stock_compiled": ratio(strict.get(best), s["stock_compiled"]),
            "strict_eager_over_stock_eager": ratio(s["strict_eager"], s["stock_eager"]),
            "strict_compiled_over_stock_compiled": ratio(s["strict_compiled"], s["stock_compiled"]),
            "best_stock": best_stock,
            "strict_over_best_stock": ratio(strict.get(best), stock.get(best_stock)),
            "strict_graphed_over_stock_compiled_graphed": ratio(s["strict_graphed"], s["stock_compiled_graphed"]),
            "errors": {v: r["error"] for v, r in per_variant.items() if "error" in r},
            "variants": per_variant}


def _dynamo_stats() -> dict:
    from torch._dynamo.utils import counters

    return {"unique_graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values())}


def merge(paths: list[Path], out: Path) -> Path:
    """Join the rows of several runs of one commit on one GPU into one JSON (one device call per
    run); refuses runs of different commits or GPUs, or two rows of one (S, measure)."""
    payloads = [json.loads(Path(p).read_text()) for p in paths]
    for key in ("git_commit", "gpu"):
        values = {p["environment"][key] for p in payloads}
        if len(values) != 1:
            raise SystemExit(f"refusing to merge runs of different {key}: {sorted(map(str, values))}")
    rows = sorted((r for p in payloads for r in p["rows"]), key=lambda r: (r["S"], r["measure"]))
    keys = [(r["S"], r["measure"]) for r in rows]
    if len(set(keys)) != len(keys):
        raise SystemExit(f"refusing to merge: (S, measure) measured twice in {keys}")
    merged = {**payloads[0], "complete": all(p["complete"] for p in payloads), "rows": rows,
              "runs": [{"file": Path(path).name, "environment": p["environment"], "gate": p["gate"],
                        "settings": p["settings"]} for path, p in zip(paths, payloads)]}
    return harness.write_json(out, merged)


def _csv(choices):
    def parse(text: str) -> list[str]:
        items = [t for t in text.split(",") if t]
        unknown = sorted(set(items) - set(choices))
        if unknown or not items:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(choices)}")
        return items
    return parse


def _extra(parser) -> None:
    parser.add_argument("--seq", type=int, nargs="+", default=None, help=f"sequence lengths (default {FULL_SEQ})")
    parser.add_argument("--measures", type=_csv(MEASURES), default=list(MEASURES), help="forward,step")
    parser.add_argument("--variants", type=_csv(tuple(VARIANTS)), default=None,
                        help=f"{','.join(VARIANTS)} (default: all on CUDA; {','.join(PLAIN_VARIANTS)} on CPU, "
                             "where nothing can be captured)")
    parser.add_argument("--layers", type=int, default=None,
                        help=f"transformer blocks (default {FULL_LAYERS}; the tiny model's 2 with --smoke)")
    parser.add_argument("--breakdown-seq", type=int, nargs="*", default=None,
                        help=f"S values whose steps are profiled (default {BREAKDOWN_SEQ})")
    parser.add_argument("--fullgraph", action=argparse.BooleanOptionalAction, default=True,
                        help="compile_repeated_blocks(fullgraph=...) (default on)")
    parser.add_argument("--compile-backend", default=None,
                        help="torch.compile backend (default inductor; eager with --smoke, which checks the plumbing)")
    parser.add_argument("--compile-mode", default=None,
                        help="torch.compile mode of the regional compile (default none; reduce-overhead: CUDA graphs)")
    parser.add_argument("--recompile-limit", type=int, default=RECOMPILE_LIMIT,
                        help=f"torch._dynamo.config.recompile_limit (default {RECOMPILE_LIMIT})")
    parser.add_argument("--merge", type=Path, nargs="+", default=None, help="join these result JSONs into --out")


def main(argv=None) -> int:
    from flowlock.models.minimax_h3.tiny import TINY_H3_CONFIG, full_width_config

    args = harness.parse_args(__doc__.splitlines()[0], argv, _extra, iters=3, warmup=1)
    if args.merge:
        print(f"wrote {merge(args.merge, args.out)}")
        return 0
    device = torch.device(args.device)
    if args.variants is None:
        args.variants = list(VARIANTS if device.type == "cuda" else PLAIN_VARIANTS)
    gate = harness.gate_or_exit(args, list(GATE_TESTS))
    torch.backends.cuda.matmul.allow_tf32 = False
    if args.smoke:
        config = dict(TINY_H3_CONFIG, num_layers=args.layers or TINY_H3_CONFIG["num_layers"])
        seqs, text_rows, profiled = tuple(args.seq or SMOKE_SEQ), SMOKE_TEXT_ROWS, SMOKE_SEQ
    else:
        config = full_width_config(num_layers=args.layers or FULL_LAYERS, num_refiner_layers=REFINER_LAYERS)
        seqs, text_rows, profiled = tuple(args.seq or FULL_SEQ), TEXT_ROWS, BREAKDOWN_SEQ
    profiled = set(profiled if args.breakdown_seq is None else args.breakdown_seq)
    t0 = time.perf_counter()
    model = build_model(config, device)
    handle = flowlock.patch(model, mode="strict")
    compiling = any(VARIANTS[v][1] for v in args.variants)
    backend = args.compile_backend or ("eager" if args.smoke else "inductor")
    compiled = {}
    if compiling:
        torch._dynamo.config.recompile_limit = args.recompile_limit
        compiled = compile_blocks(model, args.fullgraph, backend, args.compile_mode)
    paths = Paths(model, handle, compiled)
    bench = ModelBench(model, paths, config, text_rows, args, device)
    build_s = time.perf_counter() - t0
    payload = {"benchmark": "model", "smoke": args.smoke, "complete": False, "config": config,
               "parameters": sum(p.numel() for p in model.parameters()),
               "parameter_tensors": len(list(model.parameters())), "build_s": build_s, "gate": gate,
               "environment": {**harness.environment(device),
                               "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")},
               "settings": {"seq": list(seqs), "measures": args.measures, "variants": args.variants,
                            "rounds": args.iters, "warmup_rounds": args.warmup, "breakdown_seq": sorted(profiled),
                            "gradient_checkpointing": True, "batch": 1,
                            "compile": {"api": "compile_repeated_blocks", "fullgraph": args.fullgraph,
                                        "mode": args.compile_mode,
                                        "backend": backend, "recompile_limit": args.recompile_limit}},
               "method": "one model instance; strict = flowlock.patch, stock = the patch detached; compiled = "
                         "compile_repeated_blocks, dynamo reset per S; step = forward + backward, no optimizer; "
                         "same process, one first call per variant, "
                         "then warm-up and timed rounds of one call per variant, first variant rotating; CUDA "
                         "events; median/min/max; zero_grad(set_to_none) untimed",
               "rows": []}
    try:
        for seq in seqs:
            if compiling:
                torch._dynamo.reset()  # static shapes per S, as for one fixed layout; no stale graphs
                torch._dynamo.utils.counters.clear()
            t0 = time.perf_counter()
            rows = bench.rows(seq, profile=seq in profiled)
            for row in rows:
                row["seq_wall_s"] = time.perf_counter() - t0
                if compiling:
                    row["dynamo"] = _dynamo_stats()
                payload["rows"].append(row)
                print(_summary(row), flush=True)
            # Written after every S, so a run stopped at the device call's time limit keeps its rows.
            harness.write_json(args.out, payload)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        paths.use("strict_eager")
        handle.remove()
    payload["complete"] = True
    print(f"wrote {harness.write_json(args.out, payload)}")
    return 0


def _summary(row: dict) -> str:
    def fmt(x, spec):
        return "-" if x is None else format(x, spec)

    times = " ".join(f"{v}={fmt(row[f'{v}_s'], '.3f')}" for v in VARIANTS)
    return (f"S={row['S']} {row['measure']}: {times} s; best strict ({row['best_strict']}) / stock eager "
            f"{fmt(row['strict_over_stock_eager'], '.3f')}, / stock compiled "
            f"{fmt(row['strict_over_stock_compiled'], '.3f')}, / best stock ({row['best_stock']}) "
            f"{fmt(row['strict_over_best_stock'], '.3f')}"
            f"; peak GiB strict {fmt(row['strict_peak_gib'], '.1f')} stock {fmt(row['stock_peak_gib'], '.1f')}"
            + "".join(f"\n  {v} failed: {e.splitlines()[0][:300]}" for v, e in row["errors"].items()))


if __name__ == "__main__":
    sys.exit(main())
