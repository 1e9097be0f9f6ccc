"""``flowlock`` command line: demo, check, trace, bench, convert. Argument parsing and dispatch only:
the runs and their reports live in :mod:`flowlock.validate` (reports: :mod:`flowlock.validate.report`,
``rich`` tables on a terminal, plain text otherwise, JSON with ``--json``).

``flowlock demo``   one RL step, strict against stock diffusers (:mod:`flowlock.validate.demo`);
                    ``--rollout vllm-omni`` samples in vLLM-Omni and replays in diffusers instead.
``flowlock check``  the validation suites (:mod:`flowlock.validate.suites`); exit status 1 on any failure.
``flowlock trace``  first divergence between a sample alone and inside a batch, strict and stock;
                    ``--rollout vllm-omni``: the first module where vLLM-Omni and diffusers differ;
                    ``--rollout verl-omni``: the first record field, transition or module where a
                    verl-omni H3 FlowGRPO rollout and its actor replay differ;
                    ``--layout L [--against ulysses=1]``: the first module and rank where layout L
                    differs from one process (gloo subprocesses).
``flowlock bench``  the benchmark scripts in ``benchmarks/`` (each refuses to run on a red test gate);
                    flags after the names go to the scripts.
``flowlock convert`` a diffusers H3 checkpoint directory to vLLM-Omni native names or back
                    (:mod:`flowlock.checkpoint`); exit status 1 with the reason on refused input.

Nothing is imported or computed at import time beyond argument parsing; ``main(argv)`` returns the
exit status.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

BENCHMARKS = ("conditioning", "block", "linear", "attention", "tp_designs", "launch_host", "memory_bound", "model",
              "nonfinite")
# Run only when named: the full-depth model needs a whole H200 (and, for `model`, several device calls).
NAMED_ONLY = ("model", "nonfinite")


def _device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("flowlock: --device cuda requested but no CUDA device is available")
    return torch.device(name)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _rollout_engine_run(args: argparse.Namespace, run, report_blocks) -> int:
    """A ``--rollout vllm-omni`` / ``verl-omni`` run: ``run(device)`` builds the tiny H3 in both engines
    and returns a payload with ``ok``; ``report_blocks(payload)`` is its report."""
    import importlib.util

    if importlib.util.find_spec("vllm_omni") is None or importlib.util.find_spec("vllm") is None:
        print(f"flowlock: --rollout {args.rollout} needs vllm 0.30.0 and vllm-omni 0.30.0 installed "
              "(see requirements/vllm-cpu.txt)", file=sys.stderr)
        return 2
    from flowlock.integrations.vllm_omni.runtime import NoAttentionBackend
    from flowlock.validate.report import show, write_json

    try:
        payload = run(_device(args.device))
    except NoAttentionBackend as err:
        print(f"flowlock: {err}", file=sys.stderr)
        return 2
    show(report_blocks(payload))
    if args.json:
        write_json(args.json, payload)
    return 0 if payload["ok"] else 1


def _across_engines(args: argparse.Namespace) -> int:
    """``demo`` / ``trace`` with ``--rollout vllm-omni`` (:mod:`flowlock.validate.engines`)."""
    from flowlock.validate import engines

    options = {"n_requests": args.samples, "steps": args.steps} if args.command == "demo" else {"consistency": False}
    return _rollout_engine_run(args, lambda device: engines.engine_demo(device, **options), engines.report_blocks)


def _verl_omni_trace(args: argparse.Namespace) -> int:
    """``trace --rollout verl-omni`` (:mod:`flowlock.validate.verl_trace`)."""
    from flowlock.validate import verl_trace

    return _rollout_engine_run(args, verl_trace.trace_verl_omni, verl_trace.report_blocks)


def cmd_demo(args: argparse.Namespace) -> int:
    if args.rollout == "vllm-omni":
        ignored = [flag for flag, value, default in (("--model", args.model, None), ("--plot", args.plot, None),
                                                     ("--width", args.width, "tiny"), ("--layers", args.layers, 2),
                                                     ("--seq", args.seq, None), ("--rounds", args.rounds, 5))
                   if value != default]
        if ignored:
            print(f"flowlock demo: --rollout vllm-omni runs its own tiny H3 and no timing; it does not take "
                  f"{', '.join(ignored)}", file=sys.stderr)
            return 2
        return _across_engines(args)
    from flowlock.models.minimax_h3.packing import packing_for_length
    from flowlock.validate.demo import load_model, run_demo
    from flowlock.validate.demo_report import demo_blocks
    from flowlock.validate.report import show, write_json

    try:
        layout = None if args.seq is None else packing_for_length(args.seq)
    except ValueError as err:
        print(f"flowlock demo: --seq {args.seq}: {err}", file=sys.stderr)
        return 2
    device = _device(args.device)
    model, description = load_model(args.model, device, args.width, args.layers)
    try:
        payload = run_demo(model, description, samples=args.samples, steps=args.steps, layout=layout,
                           rounds=args.rounds, evidence_root=_repo_root())
    except NotImplementedError as err:  # run_consistency's documented signal that a strict piece is missing
        print(f"flowlock demo: the strict path cannot run this model: {err}", file=sys.stderr)
        return 2
    show(demo_blocks(payload))
    if args.json:
        write_json(args.json, payload)
        print(f"wrote {args.json}")
    if args.plot:
        from flowlock.validate.demo_plot import plot_demo

        print(f"wrote {plot_demo(payload, args.plot)}")
    return 0 if payload["ok"] else 1


def _trace_layout(args: argparse.Namespace) -> int:
    """``trace --layout``: :func:`flowlock.validate.layout_trace.trace_layouts` on gloo subprocesses."""
    from flowlock.validate.layout_spec import parse_parallel_layout
    from flowlock.validate.layout_trace import LayoutJobFailed, describe, trace_layouts
    from flowlock.validate.report import write_json

    modes = ("strict", "provider") if args.mode == "both" else (args.mode,)
    try:
        ulysses = parse_parallel_layout(args.layout, "trace").ulysses
        if "provider" in modes and args.seq % ulysses:
            raise ValueError(f"the stock diffusers path (provider) needs S divisible by the Ulysses degree "
                             f"{ulysses}; got --seq {args.seq}")
        report = trace_layouts(args.layout, args.against, runs=tuple((m, args.seq) for m in modes))
    except LayoutJobFailed as err:
        print(err)
        if args.json:
            write_json(args.json, {"ok": False, "failed_jobs": err.jobs})
        return 1
    except (ValueError, RuntimeError) as err:
        print(f"flowlock trace: {err}", file=sys.stderr)
        return 2
    print(describe(report))
    if args.json:
        write_json(args.json, report)
    return 0 if report["ok"] else 1


def cmd_trace(args: argparse.Namespace) -> int:
    if args.layout:
        if args.rollout != "diffusers":
            print("flowlock trace: --layout traces the diffusers trainer path; it does not combine with --rollout",
                  file=sys.stderr)
            return 2
        return _trace_layout(args)
    if args.rollout == "vllm-omni":
        return _across_engines(args)
    if args.rollout == "verl-omni":
        return _verl_omni_trace(args)
    from flowlock.validate.batch_trace import run_traces, trace_lines
    from flowlock.validate.demo import load_model
    from flowlock.validate.report import show, write_json

    device = _device(args.device)
    model, description = load_model(None, device)
    results = run_traces(model)
    show(trace_lines(results, f"{description} on {device}"))
    if args.json:
        write_json(args.json, results)
    return 0 if results["strict"]["divergence"] is None else 1


def cmd_check(args: argparse.Namespace) -> int:
    if getattr(args, "layout", None):
        return _check_layout(args)
    from flowlock.validate.demo import load_model
    from flowlock.validate.report import show, write_json
    from flowlock.validate.suites import run_suites, suites_table

    device = _device(args.device)
    model, description = load_model(None, device)
    results = run_suites(model)
    show([suites_table(results, f"flowlock check: {description} on {device}")])
    if args.json:
        write_json(args.json, results)
    return 0 if all(r["passed"] for r in results.values()) else 1


def _check_layout(args: argparse.Namespace) -> int:
    from flowlock.validate.layout import check_layout, describe
    from flowlock.validate.report import write_json

    try:
        report = check_layout(args.layout)
    except ValueError as err:
        print(f"flowlock check: {err}", file=sys.stderr)
        return 2
    print(describe(report))
    if args.json:
        write_json(args.json, report)
    return 0 if report["passed"] else 1


def _repo_root() -> Path:
    """The source checkout holding ``benchmarks/`` (flowlock is installed editable from it)."""
    import flowlock

    return Path(flowlock.__file__).resolve().parents[2]


def cmd_bench(args: argparse.Namespace) -> int:
    root = _repo_root()
    names = args.names or [n for n in BENCHMARKS
                           if n not in NAMED_ONLY and (root / "benchmarks" / f"bench_{n}.py").exists()]
    failed = []
    for name in names:
        script = root / "benchmarks" / f"bench_{name}.py"
        if not script.exists():
            print(f"flowlock bench: no benchmark {name!r} ({script} missing)", file=sys.stderr)
            failed.append(name)
            continue
        out = Path(args.out_dir) / f"{name}.json" if args.out_dir else root / "benchmarks" / "results" / f"{name}.json"
        cmd = [sys.executable, str(script), "--out", str(out)] + ["--skip-gate"] * args.skip_gate + args.script_args
        if args.smoke:
            usage = subprocess.run([sys.executable, str(script), "--help"], cwd=root, capture_output=True, text=True)
            if "--smoke" not in usage.stdout:
                print(f"flowlock bench: {name} has no --smoke mode; skipped", file=sys.stderr)
                failed.append(name)
                continue
            cmd.append("--smoke")
        print("+ " + " ".join(cmd), flush=True)
        if subprocess.run(cmd, cwd=root).returncode != 0:
            failed.append(name)
            continue
        subprocess.run([sys.executable, str(root / "benchmarks" / "plot.py"), str(out)], cwd=root)
    if failed:
        print(f"flowlock bench: failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def cmd_convert(args: argparse.Namespace) -> int:
    from flowlock.checkpoint import CheckpointError, convert_directory, sweep_partials

    conversion_only = [name for name, value in (("SRC", args.src), ("--to", args.to), ("--qkv-layout", args.qkv_layout),
                                                ("--verify", args.verify), ("--allow-nonfinite", args.allow_nonfinite))
                       if value]
    if args.clean and conversion_only:
        print(f"flowlock convert: --clean takes DST alone, not {', '.join(conversion_only)}", file=sys.stderr)
        return 2
    if not args.clean and (args.src is None or args.to is None):
        print("flowlock convert: SRC, DST and --to are required (or --clean DST)", file=sys.stderr)
        return 2
    try:
        if args.clean:
            swept = sweep_partials(args.dst)
        else:
            report = convert_directory(args.src, args.dst, to=args.to, qkv_layout=args.qkv_layout,
                                       verify=args.verify, progress=True, allow_nonfinite=args.allow_nonfinite)
            swept = report.swept
    except (CheckpointError, OSError) as err:
        print(f"flowlock convert: {err}", file=sys.stderr)
        return 1
    for path in swept.removed:
        print(f"removed {path}: a partial directory no live conversion holds")
    for path in swept.held:
        print(f"kept {path}: a live conversion holds it")
    if args.clean:
        if not swept.removed and not swept.held:
            print(f"no partial directory of {args.dst}")
        return 0
    print(f"wrote {report.dst}: {report.tensors} {report.to} tensors in {report.shards} shards "
          f"({report.bytes} bytes), native q/k/v layout {report.qkv_layout}"
          + ("; verified against its manifest" if report.verified else ""))
    for finding in report.nonfinite:
        print(f"copied with --allow-nonfinite: {finding}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flowlock", description="exactly on-policy RL for flow-matching DiTs")
    sub = parser.add_subparsers(dest="command", required=True)
    device = dict(choices=("auto", "cpu", "cuda"), default="auto",
                  help="where to run: cuda (flowlock's Triton kernels), cpu (its PyTorch reference ops), or auto: "
                       "cuda when a GPU is visible (default)")
    json_out = dict(default=None, metavar="PATH", help="also write the full report as JSON to PATH")
    demo = sub.add_parser("demo", help="one RL step, strict against stock diffusers: the conditioning chain, "
                                       "rollout vs replay log-probs and velocities, and their time")
    demo.add_argument("--device", **device)
    demo.add_argument("--model", default=None, metavar="DIR",
                      help="a diffusers MiniMaxH3Transformer3DModel checkpoint directory (default: a random-weight "
                           "H3, see --width)")
    demo.add_argument("--json", **json_out)
    demo.add_argument("--plot", default=None, metavar="PATH",
                      help="write a PNG of the per-step rollout-vs-replay differences to PATH (needs matplotlib)")
    demo.add_argument("--samples", type=_positive_int, default=4,
                      help="samples in the rollout batch, replayed in smaller micro-batches (default 4; with "
                           "--rollout vllm-omni: requests)")
    demo.add_argument("--steps", type=_positive_int, default=3, help="CPS sampling steps per sample (default 3)")
    demo.add_argument("--rounds", type=_positive_int, default=5,
                      help="timed rounds per path after one warm-up round; the report gives the median (default 5)")
    demo.add_argument("--width", choices=("tiny", "full"), default="tiny",
                      help="random-weight model without --model: the embedded tiny H3 or H3's full widths")
    demo.add_argument("--layers", type=_positive_int, default=2, help="blocks of the full-width model (default 2)")
    demo.add_argument("--seq", type=int, default=None,
                      help="rows in each sample's sequence, text + video + audio (default: the tiny H3's 24)")
    demo.set_defaults(func=cmd_demo)
    rollout = dict(choices=("diffusers", "vllm-omni"), default="diffusers",
                   help="the rollout engine: diffusers (one engine) or vLLM-Omni (replayed in diffusers)")
    demo.add_argument("--rollout", **rollout)
    for name, func, text in (("check", cmd_check, "run the validation suites (each says what it covers); "
                                                  "exit 1 on any failure"),
                             ("trace", cmd_trace, "the first module whose bits differ for a sample alone vs in a "
                                                  "batch, strict and stock; exit 1 if strict differs")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--device", **device)
        p.add_argument("--json", **json_out)
        p.set_defaults(func=func)
    from flowlock.validate.layout_spec import ONE_PROCESS, layout_help

    sub.choices["check"].add_argument("--layout", default=None, help=layout_help("check"))
    trace_parser = sub.choices["trace"]
    trace_parser.add_argument("--rollout", **{**rollout, "choices": (*rollout["choices"], "verl-omni"),
                                              "help": rollout["help"] + "; verl-omni: a FlowGRPO rollout "
                                              "in vLLM-Omni and its actor replay on verl-omni's record"})
    trace_parser.add_argument("--layout", default=None, help=layout_help("trace"))
    trace_parser.add_argument("--against", default=ONE_PROCESS.name, help="with --layout: the reference layout "
                              f"(one process, {ONE_PROCESS.name})")
    trace_parser.add_argument("--mode", choices=("strict", "provider", "both"), default="strict",
                              help="with --layout: flowlock strict, the stock diffusers path, or both")
    trace_parser.add_argument("--seq", type=int, default=25, help="with --layout: packed rows per sample "
                              "(default 25: uneven shards; the stock path needs a multiple of the degree)")
    bench = sub.add_parser("bench", help="run benchmark scripts (each gated by its CPU tests)")
    bench.add_argument("names", nargs="*", metavar="NAME",
                       help=f"benchmarks to run (default: all present of {', '.join(BENCHMARKS)} but "
                            f"{', '.join(NAMED_ONLY)}); flags after the names go to the scripts "
                            "(e.g. bench model --seq 925 --measures step)")
    bench.add_argument("--out-dir", default=None, metavar="DIR",
                       help="write each benchmark's JSON and plot to DIR (default: benchmarks/results/)")
    bench.add_argument("--skip-gate", action="store_true",
                       help="do not run each script's CPU test gate first (for device runs of a commit whose gate "
                            "already passed; the JSON records it)")
    bench.add_argument("--smoke", action="store_true",
                       help="tiny sizes, to check the scripts end to end on CPU; measures nothing")
    bench.set_defaults(func=cmd_bench)
    convert = sub.add_parser("convert", help="diffusers <-> vLLM-Omni native H3 checkpoint directory",
                             usage="flowlock convert SRC DST --to {native,diffusers} [options] | "
                                   "flowlock convert --clean DST")
    convert.add_argument("src", metavar="SRC", nargs="?", help="the checkpoint directory to convert")
    convert.add_argument("dst", metavar="DST", help="a new directory (never overwritten)")
    convert.add_argument("--to", choices=("native", "diffusers"), default=None, help="the names to convert to")
    convert.add_argument("--qkv-layout", choices=("stacked", "interleaved"), default=None,
                         help="native fused q/k/v rows: written with --to native (default interleaved, the official "
                              "shards' layout); read with --to diffusers, needed when SRC does not record it")
    convert.add_argument("--verify", action="store_true", help="re-read DST and check it against its manifest")
    convert.add_argument("--allow-nonfinite", action="store_true",
                         help="copy tensors holding NaN or Inf as they are (listed after the summary); by default "
                              "they are refused, each named with its shard and count, and nothing is written")
    convert.add_argument("--clean", action="store_true",
                         help="only remove the hidden .DST.*.partial directories that killed conversions into DST "
                              "left and no live conversion holds (a conversion does this itself before writing)")
    convert.set_defaults(func=cmd_convert)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, script_args = parser.parse_known_args(argv)
    if script_args and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(script_args)}")
    args.script_args = script_args
    return args.func(args)
