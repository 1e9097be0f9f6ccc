"""Shared benchmark machinery: environment record, paired timing, the CPU test gate, JSON output.

Scripts in ``benchmarks/`` are run as ``python benchmarks/<name>.py``; Python puts the script's
directory on ``sys.path``, so they ``import harness`` directly (``benchmarks`` is not a package).

Timing method (DESIGN §8): the two functions under comparison are timed in the same process,
alternating which one runs first on every iteration, each call bracketed by CUDA events (a
``perf_counter`` pair on CPU, for smoke runs only), with setup (graph construction, fresh inputs)
outside the timed region; the report is the median and the 20th/80th percentiles of >= 20 timed
calls after warm-up. Calls too long to repeat 20 times (a full-depth training step) are timed in
rounds instead (:func:`time_rounds`): the median, minimum and maximum of a few rounds.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import os
import pstats
import re
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
MIN_ITERS = 20


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def environment(device: torch.device) -> dict:
    """Where and with what a result was measured (``git_dirty`` counts tracked files only; ``None``
    when FLOWLOCK_COMMIT names the commit, since the copy's own git state is not trusted then)."""
    named = os.environ.get("FLOWLOCK_COMMIT")
    status = None if named else _git("status", "--porcelain", "--untracked-files=no")
    env = {
        # A copied tree on a device machine names its commit in FLOWLOCK_COMMIT; its .git, if any,
        # can be stale, so the variable wins over git.
        "git_commit": named or _git("rev-parse", "HEAD"),
        "git_dirty": None if status is None else bool(status),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "diffusers": _version("diffusers"),
        "python": sys.version.split()[0],
    }
    return env


def _stats(samples_ms: list[float]) -> dict:
    ordered = sorted(samples_ms)
    q = statistics.quantiles(ordered, n=10, method="inclusive")
    return {"median_ms": statistics.median(ordered), "p20_ms": q[1], "p80_ms": q[7], "n": len(ordered)}


# GPU clock cycles of the spin that keeps the device busy ahead of a queued call (about 5 ms on an
# H200): longer than any op's host time, so every launch of the call is queued before the spin ends.
QUEUE_SPIN_CYCLES = 10_000_000


class _Timer:
    """CUDA events on a GPU; ``perf_counter`` on CPU (smoke runs).

    Idle (default): the call starts on an idle device, so the host time before its first launch
    and between launches counts. Queued: the call is enqueued behind a GPU spin, as inside a model
    forward where the host runs ahead; the events then measure the call's kernels back to back.
    """

    def __init__(self, device: torch.device, queued: bool = False):
        self.cuda = device.type == "cuda"
        self.queued = queued

    def __call__(self, fn: Callable[[object], object], state: object) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            if self.queued:
                torch.cuda._sleep(QUEUE_SPIN_CYCLES)
            start.record()
            fn(state)
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        fn(state)
        return (time.perf_counter() - t0) * 1e3


def time_pair(fn_a: Callable[[object], object], fn_b: Callable[[object], object], *, device: torch.device,
              setup_a: Callable[[], object] | None = None, setup_b: Callable[[], object] | None = None,
              iters: int = MIN_ITERS, warmup: int = 3, queued: bool = False) -> dict:
    """Time ``fn_a(setup_a())`` against ``fn_b(setup_b())``; only the ``fn`` calls are timed, from
    an idle device or, with ``queued``, enqueued behind a GPU spin (see :class:`_Timer`).

    The order alternates every iteration (a first on even iterations, b first on odd ones) so
    clock ramps and cache state do not favour either. Returns ``{"a": stats, "b": stats,
    "ratio_a_over_b": median_a / median_b}`` with stats ``median_ms``, ``p20_ms``, ``p80_ms``, ``n``.
    """
    if iters < MIN_ITERS:
        raise ValueError(f"iters must be >= {MIN_ITERS}, got {iters}")
    samples = _rounds({"a": fn_a, "b": fn_b}, {"a": setup_a, "b": setup_b}, _Timer(device, queued), warmup, iters)
    a, b = _stats(samples["a"]["samples_ms"]), _stats(samples["b"]["samples_ms"])
    return {"a": a, "b": b, "ratio_a_over_b": a["median_ms"] / b["median_ms"]}


def time_rounds(fns: dict[str, Callable[[object], object]], *, device: torch.device,
                setups: dict[str, Callable[[], object]] | None = None, rounds: int = 3, warmup: int = 1,
                after: Callable[[str], None] | None = None) -> dict[str, dict]:
    """Time several functions against each other in rounds: every round calls each ``fns[k](setups[k]())``
    once, idle-device timing as :func:`time_pair`, and the first function of a round rotates
    (with two functions that is ``time_pair``'s alternation).

    For calls too long for >= 20 repetitions. ``after(name)`` runs after each timed call, outside
    the timed region (reading peak memory, say). A function that raises is dropped from the later
    rounds and reported as ``{"error": "Type: message"}`` instead of ending the run; the others
    report ``median_ms``, ``min_ms``, ``max_ms``, ``n``, ``samples_ms`` and ``warmup_ms`` (the
    warm-up calls' times, which carry compilation).
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    timed = _rounds(fns, setups or {}, _Timer(device), warmup, rounds, after=after, record_errors=True)
    return {name: r if "error" in r else {**_spread(r["samples_ms"]), **r} for name, r in timed.items()}


def median_ms(fn: Callable[[], object], *, device: torch.device, repeats: int,
              before: Callable[[], object] | None = None) -> float:
    """The median time (ms) of ``repeats`` calls of ``fn()`` after one untimed warm-up call, each timed
    from an idle device as :func:`time_rounds` times it. ``before()`` runs ahead of every timed call,
    untimed: a barrier, so that every rank of a job starts the call together."""
    timer = _Timer(device)
    fn()
    samples = []
    for _ in range(repeats):
        if before is not None:
            before()
        samples.append(timer(lambda _: fn(), None))
    return statistics.median(samples)


def _spread(samples_ms: list[float]) -> dict:
    return {"median_ms": statistics.median(samples_ms), "min_ms": min(samples_ms), "max_ms": max(samples_ms),
            "n": len(samples_ms)}


def _rounds(fns: dict, setups: dict, timer: _Timer, warmup: int, rounds: int,
            after: Callable[[str], None] | None = None, record_errors: bool = False) -> dict[str, dict]:
    """``warmup + rounds`` rounds of one call per function, round ``i`` starting at function ``i mod
    len(fns)``; returns per name ``samples_ms`` and ``warmup_ms``, or ``error`` once it raised."""
    names = list(fns)
    out: dict[str, dict] = {name: {"samples_ms": [], "warmup_ms": []} for name in names}
    # No function left (every variant failed before timing): nothing to time, not a division by zero.
    for it in range(warmup + rounds if names else 0):
        k = it % len(names)
        for name in names[k:] + names[:k]:
            if "error" in out[name]:
                continue
            setup = setups.get(name) or (lambda: None)
            try:
                ms = timer(fns[name], setup())
            except Exception as err:  # recorded for the result, so one failing variant cannot end the run
                if not record_errors:
                    raise
                out[name] = {"error": f"{type(err).__name__}: {err}"}
                continue
            out[name]["warmup_ms" if it < warmup else "samples_ms"].append(ms)
            if it >= warmup and after is not None:
                after(name)
    return out


def host_profile(fn: Callable[[], object], device: torch.device, top: int = 30) -> dict:
    """Where one call of ``fn`` spends host time: ``cProfile`` over the call and a device synchronize,
    returning its wall time (profiled, so slower than an unprofiled call) and the ``top`` functions by
    own time and by cumulative time (``file:line(function)``, calls, ms). The device time of the same
    call comes from the kernel breakdown; the difference between the two is host-bound time."""
    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.enable()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    profiler.disable()
    wall_ms = (time.perf_counter() - t0) * 1e3
    stats = pstats.Stats(profiler).stats

    def rows(key: int) -> list[dict]:
        ranked = sorted(stats.items(), key=lambda kv: -kv[1][key])[:top]
        return [{"function": f"{Path(file).name}:{line}({name})", "calls": calls, "own_ms": own * 1e3,
                 "cumulative_ms": cum * 1e3} for (file, line, name), (_, calls, own, cum, _) in ranked]

    return {"profiled_wall_ms": wall_ms, "calls": sum(v[1] for v in stats.values()),
            "by_own_time": rows(2), "by_cumulative_time": rows(3)}


def gpu_idle(fn: Callable[[], object], device: torch.device, top: int = 15,
             name_of: Callable[[str], str] = lambda name: name) -> dict | None:
    """When the GPU waits during one call of ``fn``: the CUDA activity of the call under the profiler
    (CUDA only: no CPU op recording to slow the host), its kernels' busy time against their span,
    and each idle gap charged to the kernel it preceded (``name_of`` groups kernel names). A gap
    before a kernel is, when host-bound, the host time of the op that launched it. ``None`` off CUDA.
    """
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    wall_ms = (time.perf_counter() - t0) * 1e3
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    return {"profiled_wall_ms": wall_ms, **idle_gaps(spans, name_of, top)}


def idle_gaps(spans: list[tuple[float, float, str]], name_of: Callable[[str], str] = lambda name: name,
              top: int = 15) -> dict:
    """Busy, span and idle time (ms) of device activity ``spans`` ((start_us, end_us, name), sorted by
    start; overlaps count once), each idle gap charged to the activity that ended it, grouped by
    ``name_of`` and ranked by idle time."""
    if not spans:
        return {"kernels": 0}
    busy = idle = 0.0
    covered = spans[0][0]
    charged: dict[str, list] = {}
    gaps_over = {10: 0, 100: 0}
    for start, end, name in spans:
        if start > covered:
            gap = start - covered
            idle += gap
            entry = charged.setdefault(name_of(name), [0.0, 0])
            entry[0] += gap
            entry[1] += 1
            for limit in gaps_over:
                gaps_over[limit] += gap > limit
        busy += max(0.0, end - max(start, covered))
        covered = max(covered, end)
    ranked = sorted(charged.items(), key=lambda kv: -kv[1][0])[:top]
    return {"kernels": len(spans), "gpu_busy_ms": busy / 1e3, "gpu_span_ms": (covered - spans[0][0]) / 1e3,
            "gpu_idle_ms": idle / 1e3, "gaps_over_10us": gaps_over[10], "gaps_over_100us": gaps_over[100],
            "idle_before": [{"kernel": k, "idle_ms": v[0] / 1e3, "gaps": v[1]} for k, v in ranked]}


def test_gate(pytest_args: Sequence[str], *, skip: bool = False) -> dict:
    """Run the given CPU test files under the Triton interpreter; a record for the result JSON.

    ``skip`` (``--skip-gate``) is for device runs whose commit already passed the gate on CPU; the
    record then says the gate did not run here.
    """
    if skip:
        return {"ran": False, "passed": None, "args": list(pytest_args)}
    env = dict(os.environ, TRITON_INTERPRET="1")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args],
                          cwd=REPO, env=env, capture_output=True, text=True)
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-5:]
    return {"ran": True, "passed": proc.returncode == 0, "returncode": proc.returncode,
            "args": list(pytest_args), "seconds": round(time.perf_counter() - t0, 1), "tail": tail}


def parse_args(description: str, argv: Sequence[str] | None = None,
               extra: Callable[[argparse.ArgumentParser], None] | None = None, *, iters: int = MIN_ITERS,
               warmup: int = 3) -> argparse.Namespace:
    """The flags every benchmark takes: ``--out``, ``--skip-gate``, ``--iters``, ``--warmup``,
    ``--device``, ``--smoke`` (tiny sizes, to check a script end to end on CPU). ``iters`` and
    ``warmup`` are the defaults of those two flags."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, required=True, help="result JSON path")
    parser.add_argument("--skip-gate", action="store_true", help="do not run the CPU test gate (record that)")
    parser.add_argument("--iters", type=int, default=iters, help=f"timed iterations (default {iters})")
    parser.add_argument("--warmup", type=int, default=warmup, help=f"untimed warm-up iterations (default {warmup})")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: checks the script, measures nothing")
    if extra is not None:
        extra(parser)
    return parser.parse_args(argv)


def gate_or_exit(args: argparse.Namespace, pytest_args: Sequence[str]) -> dict:
    """Run the gate; print why and exit with status 2 when it fails."""
    gate = test_gate(pytest_args, skip=args.skip_gate)
    if gate["ran"] and not gate["passed"]:
        print("test gate failed; refusing to benchmark:\n" + "\n".join(gate["tail"]), file=sys.stderr)
        raise SystemExit(2)
    return gate


def write_json(path: Path, payload: dict) -> Path:
    """Write ``payload`` (indented, keys in insertion order) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return path


def kernel_prefix(name: str) -> str:
    """Group kernel names: drop template/argument lists and trailing specialisation suffixes."""
    name = re.sub(r"^void ", "", name)
    name = re.split(r"[<(\s]", name, maxsplit=1)[0]
    *space, leaf = name.split("::")
    if not leaf.startswith("_"):
        leaf = "_".join(leaf.split("_")[:3])
    return "::".join(space[-1:] + [leaf]) or "<unnamed>"


def kernel_times(fn, device: torch.device, top: int = 25) -> list[dict]:
    """Device time (ms) of one call of ``fn``, grouped by kernel-name prefix, largest first (CPU op
    time off CUDA)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    groups: dict[str, float] = defaultdict(float)
    for evt in prof.key_averages():
        if device.type == "cuda":
            if evt.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0.0)
        else:
            us = evt.self_cpu_time_total
        if us > 0:
            groups[kernel_prefix(evt.key)] += us / 1e3
    ranked = sorted(groups.items(), key=lambda kv: -kv[1])
    return [{"kernel": k, "ms": v} for k, v in ranked[:top]]
