"""``flowlock`` command line: demo, check, trace, bench, convert.

``flowlock demo``   the conditioning-chain table (strict and provider: invariance, repeatability
                    per stage) and the RL rollout/replay consistency run side by side;
                    ``--rollout vllm-omni`` samples in vLLM-Omni and replays in diffusers instead.
``flowlock check``  the validation suites; exit status 1 on any failure.
``flowlock trace``  first divergence between a sample alone and inside a batch, strict and provider;
                    ``--rollout vllm-omni``: the first module where vLLM-Omni and diffusers differ;
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
import json
import subprocess
import sys
from pathlib import Path

BENCHMARKS = ("conditioning", "block", "linear", "attention", "tp_designs", "launch_host", "memory_bound", "model")
# Run only when named: the full-depth model needs a whole H200 and several device calls.
NAMED_ONLY = ("model",)


def _device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("flowlock: --device cuda requested but no CUDA device is available")
    return torch.device(name)


def _load_model(model_dir: str | None, device, width: str = "tiny", layers: int = 2):
    """The diffusers H3 from ``model_dir`` (checkpoint dtypes: BF16 with the FP32 modules), else a
    random-weight H3: the embedded tiny one, or H3's full widths with ``layers`` blocks."""
    import torch

    if model_dir is None and width == "tiny":
        from flowlock.models.minimax_h3.tiny import tiny_h3

        return tiny_h3(device=device), "tiny embedded H3 (random weights)"
    if model_dir is None:
        from flowlock.models.minimax_h3.tiny import full_width_config, make_h3

        model = make_h3(full_width_config(num_layers=layers, num_refiner_layers=1), device=device,
                        draw_on_device=device.type == "cuda")
        return model, f"full-width H3, {layers} blocks + 1 refiner block (random weights)"
    from diffusers import MiniMaxH3Transformer3DModel

    model = MiniMaxH3Transformer3DModel.from_pretrained(model_dir, torch_dtype=torch.bfloat16)
    return model.to(device).eval(), f"diffusers checkpoint {model_dir}"


def _patch(model):
    import flowlock

    return flowlock.patch(model, mode="strict")


def _model_backends(model) -> list[str]:
    """The (op, backend) pairs one strict forward of ``model`` actually dispatched to."""
    import torch

    import flowlock
    from flowlock.models.minimax_h3.tiny import tiny_inputs

    device = next(model.parameters()).device
    inputs = tiny_inputs(1, seed=0, config=dict(model.config), device=device)
    handle = _patch(model)
    try:
        with torch.no_grad(), flowlock.mode("strict") as frame:
            model(**inputs)
    finally:
        handle.remove()
    return sorted({f"{op}:{backend}" for op, backend in frame.ran})


def _yes(flag: bool) -> str:
    return "yes" if flag else "NO"


def chain_table(report: dict) -> str:
    """The per-stage table of a :func:`flowlock.validate.chain.chain_replay` report."""
    head = (f"{'stage':18s} | {'strict repeat':13s} {'strict invariant':16s} | {'provider repeat':15s} "
            f"{'provider invariant':18s} | {'chained = provider':18s} {'local = provider':16s}")
    lines = [head, "-" * len(head)]
    for ours, theirs in zip(report["flowlock"]["stages"], report["provider"]["stages"]):
        chained = "yes" if ours["chained_vs_provider"] else f"no ({ours['chained_mismatches']}/{ours['numel']})"
        local = "yes" if ours["local_vs_provider"] else f"no ({ours['local_mismatches']}/{ours['numel']})"
        lines.append(f"{ours['stage']:18s} | {_yes(ours['repeat_equal']):13s} {_yes(ours['invariant']):16s} | "
                     f"{_yes(theirs['repeat_equal']):15s} {_yes(theirs['invariant']):18s} | {chained:18s} {local:16s}")
    for name in ("flowlock", "provider"):
        path = report[name]
        if path["grads"]:
            varying = [g["param"] for g in path["grads"] if not g["repeat_equal"]]
            label = "strict" if name == "flowlock" else name
            lines.append(f"{label} backward: {len(path['grads']) - len(varying)}/{len(path['grads'])} parameter "
                         f"gradients repeatable; input gradient repeatable {_yes(path['x_grad_repeat_equal'])}, "
                         f"invariant {_yes(path['x_grad_invariant'])}")
    lines.append(f"first stage where strict and provider part: {report['first_drifting_stage'] or 'none'}")
    return "\n".join(lines)


def consistency_table(strict: dict, provider: dict) -> str:
    """Per-step strict vs provider rollout/replay log-prob agreement."""
    head = (f"{'step':4s} | {'strict max|dlogp|':17s} {'mismatch':8s} {'ratio spread':12s} | "
            f"{'provider max|dlogp|':19s} {'mismatch':8s} {'ratio spread':12s}")
    lines = [head, "-" * len(head)]
    for s, p in zip(strict["per_step"], provider["per_step"]):
        lines.append(f"{s['step']:4d} | {s['max_abs_dlogp']:17.3e} {s['logp_mismatches']:8d} "
                     f"{s['ratio_spread']:12.3e} | {p['max_abs_dlogp']:19.3e} {p['logp_mismatches']:8d} "
                     f"{p['ratio_spread']:12.3e}")
    lines.append(f"velocity elements differing rollout vs replay: strict "
                 f"{sum(s['velocity_mismatches'] for s in strict['per_step'])}, provider "
                 f"{sum(s['velocity_mismatches'] for s in provider['per_step'])} of "
                 f"{sum(s['velocity_elements'] for s in strict['per_step'])}")
    per = {name: (r["seconds"]["rollout"] + r["seconds"]["replay"]) / r["seconds"]["timed_transitions"]
           for name, r in (("strict", strict), ("provider", provider))}
    lines.append(f"wall seconds per RL step (rollout + replay of one transition, from the second step on when there "
                 f"is one: the first compiles kernels): strict {per['strict']:.3f}, provider {per['provider']:.3f} "
                 f"(ratio {per['strict'] / per['provider']:.2f})")
    return "\n".join(lines)


def _plot_demo(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_d, ax_m) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, marker in (("strict", "o"), ("provider", "s")):
        steps = payload["consistency"][mode]["per_step"]
        ax_d.plot([s["step"] for s in steps], [s["max_abs_dlogp"] for s in steps], marker=marker, label=mode)
        ax_m.plot([s["step"] for s in steps], [s["logp_mismatches"] for s in steps], marker=marker, label=mode)
    ax_d.set_yscale("symlog", linthresh=1e-8)
    ax_d.set_xlabel("step")
    ax_d.set_ylabel("max |logp replay - logp rollout|")
    ax_m.set_xlabel("step")
    ax_m.set_ylabel("samples with differing log-prob bits")
    for ax in (ax_d, ax_m):
        ax.legend()
    fig.suptitle(f"flowlock demo on {payload['device']}: rollout vs replay", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _across_engines(args: argparse.Namespace) -> int:
    """``demo`` / ``trace`` with ``--rollout vllm-omni`` (:mod:`flowlock.validate.engines`)."""
    import importlib.util

    if importlib.util.find_spec("vllm_omni") is None or importlib.util.find_spec("vllm") is None:
        print("flowlock: --rollout vllm-omni needs vllm 0.30.0 and vllm-omni 0.30.0 installed "
              "(see requirements/vllm-cpu.txt)", file=sys.stderr)
        return 2
    from flowlock.integrations.vllm_omni.runtime import NoAttentionBackend
    from flowlock.validate.engines import engine_demo, format_report

    try:
        payload = engine_demo(_device(args.device), **({"n_requests": args.samples, "steps": args.steps}
                                                        if args.command == "demo" else {"consistency": False}))
    except NoAttentionBackend as err:
        print(f"flowlock: {err}", file=sys.stderr)
        return 2
    print(format_report(payload))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    return 0 if payload["ok"] else 1


def cmd_demo(args: argparse.Namespace) -> int:
    if args.rollout == "vllm-omni":
        return _across_engines(args)
    from flowlock.models.minimax_h3.layout import layout_for_length
    from flowlock.validate.chain import chain_replay
    from flowlock.validate.consistency import run_consistency

    device = _device(args.device)
    model, origin = _load_model(args.model, device, args.width, args.layers)
    layout = None if args.seq is None else layout_for_length(args.seq)
    print(f"flowlock demo: {origin} on {device}")
    chain = chain_replay(model)
    backends = _model_backends(model)
    print(f"flowlock ops ran on: {', '.join(sorted(set(chain['backends']) | set(backends)))}")
    print("\nconditioning chain (timestep -> AdaLN -> modulation), sample alone vs in a batch of "
          f"{chain['batch']}, {chain['repeats']} repeats:")
    print(chain_table(chain))
    try:
        if device.type == "cuda":
            # One untimed pass per mode first, so kernel compilation stays out of the step times.
            for mode in ("strict", "provider"):
                run_consistency(model, n_samples=1, steps=1, layout=layout, mode=mode)
        runs = {mode: run_consistency(model, n_samples=args.samples, steps=args.steps, layout=layout, mode=mode)
                for mode in ("strict", "provider")}
    except NotImplementedError as err:  # run_consistency's documented signal that a strict piece is missing
        print(f"\nRL consistency could not run strict: {err}", file=sys.stderr)
        return 2
    strict, provider = runs["strict"], runs["provider"]
    print(f"\nRL consistency: {args.samples} samples x {strict['transitions']} CPS steps, rollout batch "
          f"{strict['rollout_batch']}, replay micro-batch {strict['replay_micro_batch']} "
          f"({strict['replay_order']} order), {strict['log_prob_flavour']} log-probs:")
    print(consistency_table(strict, provider))
    provider_clean = provider["bitwise_equal"] and all(s["logp_mismatches"] == 0 for s in provider["per_step"])
    if provider_clean and device.type == "cpu":
        print("note: the provider shows no mismatches here. On a CPU at tiny sizes stock PyTorch often looks "
              "batch-invariant; that is what was measured, not a property of the provider. The discriminating "
              "evidence is on a GPU.")
    ok = chain["ok"] and strict["bitwise_equal"]
    print(f"\nstrict path exactly on-policy here: {_yes(ok)}")
    payload = {"device": str(device), "model": origin, "backends": sorted(set(chain["backends"]) | set(backends)),
               "chain": chain, "consistency": runs, "ok": ok}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        _plot_demo(payload, Path(args.plot))
        print(f"wrote {args.plot}")
    return 0 if ok else 1


def _trace_alone_vs_batched(model, mode: str, batch: int = 3, position: int = 1) -> dict:
    import flowlock
    from flowlock.models.minimax_h3.tiny import tiny_inputs
    from flowlock.validate.trace import trace

    device = next(model.parameters()).device
    inputs = tiny_inputs(batch, seed=1, config=dict(model.config), device=device)
    batched = ("hidden_states", "audio_hidden_states", "encoder_hidden_states")
    alone = {k: (v[position:position + 1] if k in batched else v) for k, v in inputs.items()}

    def run(kwargs):
        def call():
            with flowlock.mode(mode):
                return model(**kwargs)
        return call

    return trace(model, run(alone), run(inputs), batch_a=1, batch_b=batch, sample_a=0, sample_b=position)


def run_traces(model) -> dict:
    """Alone vs batched first-divergence traces of ``model``, strict (patched) and provider."""
    handle = _patch(model)
    try:
        return {mode: _trace_alone_vs_batched(model, mode) for mode in ("strict", "provider")}
    finally:
        handle.remove()


def _describe(result: dict) -> str:
    div = result["divergence"]
    if div is None:
        return f"no divergence ({result['records']} module outputs compared)"
    if div["kind"] == "structure":
        return f"structure differs at record {div['position']}: {div['module']}"
    return (f"first divergence at {div['module']} (output {div['output']}, record {div['position']} of "
            f"{result['records']}): {div['mismatches']}/{div['numel']} elements, max |diff| "
            f"{div['max_abs_diff']:.3e} (max |ref| {div['max_abs_ref']:.3e})")


def _trace_layout(args: argparse.Namespace) -> int:
    """``trace --layout``: :func:`flowlock.validate.layout_trace.trace_layouts` on gloo subprocesses."""
    from flowlock.validate.layout_spec import parse_parallel_layout
    from flowlock.validate.layout_trace import LayoutJobFailed, describe, trace_layouts

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
            Path(args.json).write_text(json.dumps({"ok": False, "failed_jobs": err.jobs}, indent=2) + "\n")
        return 1
    except (ValueError, RuntimeError) as err:
        print(f"flowlock trace: {err}", file=sys.stderr)
        return 2
    print(describe(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
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
    device = _device(args.device)
    model, origin = _load_model(None, device)
    results = run_traces(model)
    print(f"flowlock trace: {origin} on {device}, one sample alone vs at position 1 of 3")
    for mode, result in results.items():
        print(f"  {mode:8s}: {_describe(result)}")
    print(f"  (strict: {results['strict']['records']} hooked outputs, from the modules the strict forward still "
          "calls as modules; the flowlock ops inside them are not hooked)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0 if results["strict"]["divergence"] is None else 1


def _suite_chain(model) -> dict:
    from flowlock.validate.chain import chain_replay

    chain = chain_replay(model)
    return {"passed": chain["ok"], "first_drifting_stage": chain["first_drifting_stage"]}


def _suite_trace(model) -> dict:
    div = run_traces(model)["strict"]["divergence"]
    return {"passed": div is None, "divergence": div}


def _suite_consistency(model) -> dict:
    from flowlock.validate.consistency import run_consistency

    strict = run_consistency(model, n_samples=3, steps=2, mode="strict")
    return {"passed": strict["bitwise_equal"], "max_abs_dlogp": strict["max_abs_dlogp"]}


SUITES = (("chain", _suite_chain), ("trace_strict", _suite_trace), ("rl_consistency_strict", _suite_consistency))


def cmd_check(args: argparse.Namespace) -> int:
    if getattr(args, "layout", None):
        return _check_layout(args)
    device = _device(args.device)
    model, origin = _load_model(None, device)
    print(f"flowlock check: {origin} on {device}")
    results: dict[str, dict] = {}
    for name, suite in SUITES:
        try:
            results[name] = suite(model)
        except Exception as err:  # a suite that cannot run is a failed check, reported with its cause
            results[name] = {"passed": False, "error": f"{type(err).__name__}: {err}"}
        status = "PASS" if results[name]["passed"] else "FAIL"
        detail = f"  ({results[name]['error']})" if "error" in results[name] else ""
        print(f"  {status}  {name}{detail}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str) + "\n")
    return 0 if all(r["passed"] for r in results.values()) else 1


def _check_layout(args: argparse.Namespace) -> int:
    from flowlock.validate.layout import check_layout, describe

    try:
        report = check_layout(args.layout)
    except ValueError as err:
        print(f"flowlock check: {err}", file=sys.stderr)
        return 2
    print(describe(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
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
    demo = sub.add_parser("demo", help="chain replay and RL consistency, strict vs provider")
    demo.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    demo.add_argument("--model", default=None, help="a diffusers MiniMaxH3Transformer3DModel checkpoint directory")
    demo.add_argument("--json", default=None, help="write the full report here")
    demo.add_argument("--plot", default=None, help="write a PNG of the per-step log-prob agreement here")
    demo.add_argument("--samples", type=int, default=4)
    demo.add_argument("--steps", type=int, default=3)
    demo.add_argument("--width", choices=("tiny", "full"), default="tiny",
                      help="random-weight model without --model: the embedded tiny H3 or H3's full widths")
    demo.add_argument("--layers", type=int, default=2, help="blocks of the full-width model")
    demo.add_argument("--seq", type=int, default=None, help="packed rows per sample (default: 24)")
    demo.set_defaults(func=cmd_demo)
    rollout = dict(choices=("diffusers", "vllm-omni"), default="diffusers",
                   help="the rollout engine: diffusers (one engine) or vLLM-Omni (replayed in diffusers)")
    demo.add_argument("--rollout", **rollout)
    for name, func, text in (("check", cmd_check, "run the validation suites; non-zero exit on failure"),
                             ("trace", cmd_trace, "first divergence alone vs batched, strict and provider")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
        p.add_argument("--json", default=None)
        p.set_defaults(func=func)
    from flowlock.validate.layout_spec import ONE_PROCESS, layout_help

    sub.choices["check"].add_argument("--layout", default=None, help=layout_help("check"))
    trace_parser = sub.choices["trace"]
    trace_parser.add_argument("--rollout", **rollout)
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
    bench.add_argument("--out-dir", default=None)
    bench.add_argument("--skip-gate", action="store_true")
    bench.add_argument("--smoke", action="store_true")
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
