"""Run a gloo job as subprocesses of this machine, watch its ranks, and say how each one ended.

:func:`launch` starts ``world`` ranks of a rank program and polls their processes. When a rank ends
with an error (an exception, a signal, any non-zero status) the others get :data:`GRACE_S` to end
on their own, then the launcher kills them: a survivor that was inside a collective ends at once
with its own error, but a rank still in the rendezvous, waiting for a peer that died before joining,
would otherwise wait out the whole store timeout. Ranks still running at the deadline are killed too,
so a hang reports as a failure. :func:`rank_failures` tells, from each rank's exit status and
output, which rank failed first, with what exception, raised where; :func:`describe_failures` says it in lines.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from flowlock.parallel.ports import free_local_port

GRACE_S = 5.0
POLL_S = 0.05
_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ")


@dataclass
class Rank:
    """How one rank ended: its exit status, its output (stdout and stderr together), when it ended
    (seconds after the launch) and, when the launcher killed it, why."""

    returncode: int | None  # None: killed by the launcher (``stopped`` says why)
    output: str
    ended_s: float
    stopped: str | None = None


def launch(world: int, scenario: str, worker: str | Path | None = None, timeout: float = 600.0,
           pg_timeout: float = 60.0, grace: float = GRACE_S, extra_env: dict | None = None, args: list[str] = ()
           ) -> tuple[list[Rank], float]:
    """Run ``worker SCENARIO ARGS...`` (a script path, default ``-m flowlock.validate.layout_worker``) on
    ``world`` gloo ranks; return each rank's end and the wall time until the last one ended. The
    workers import the same flowlock as this process; their process group (rendezvous included) times
    out after ``pg_timeout`` s. ``grace``: how long the other ranks may run on after one failed."""
    import flowlock

    src = str(Path(flowlock.__file__).resolve().parents[1])
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_local_port()), WORLD_SIZE=str(world),
               PYTHONPATH=os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p),
               FLOWLOCK_PG_TIMEOUT=str(pg_timeout), OMP_NUM_THREADS="1", **(extra_env or {}))
    command = [sys.executable, *(["-m", "flowlock.validate.layout_worker"] if worker is None else [str(worker)]),
               scenario, *args]
    start = time.monotonic()
    with contextlib.ExitStack() as stack:
        # Files, not pipes: a rank that writes more than a pipe holds must not block while others are watched.
        logs = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in range(world)]
        procs: list[subprocess.Popen] = []
        stack.callback(_kill_running, procs)  # also on an exception or interrupt here: no rank outlives the launch
        for rank, log in enumerate(logs):
            procs.append(subprocess.Popen(command, env=dict(env, RANK=str(rank)), stdout=log,
                                          stderr=subprocess.STDOUT, text=True))
        ended, stopped = _watch(procs, start, timeout, grace)
        ranks = []
        for proc, log, end, why in zip(procs, logs, ended, stopped):
            log.seek(0)
            ranks.append(Rank(None if why else proc.returncode, log.read(), round(end, 2), why))
    return ranks, time.monotonic() - start


def _watch(procs: list[subprocess.Popen], start: float, timeout: float, grace: float
           ) -> tuple[list[float], list[str | None]]:
    """Poll until every rank has ended; kill the rest ``grace`` s after the first failure or at the deadline."""
    ended: list[float | None] = [None] * len(procs)
    stopped: list[str | None] = [None] * len(procs)
    first_failure = None
    while None in ended:
        now = time.monotonic() - start
        for r, proc in enumerate(procs):
            if ended[r] is None and proc.poll() is not None:
                ended[r] = now
                if proc.returncode != 0 and first_failure is None:
                    first_failure = (r, now)
        why = None
        if first_failure is not None and now >= first_failure[1] + grace:
            why = f"still running {grace:g} s after rank {first_failure[0]} failed"
        elif now >= timeout:
            why = f"still running at the {timeout:g} s deadline"
        if why is None:
            time.sleep(POLL_S)
            continue
        for r, proc in enumerate(procs):
            if ended[r] is None:
                proc.kill()
                proc.wait()
                ended[r], stopped[r] = time.monotonic() - start, why
    return ended, stopped


def _kill_running(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _traceback_end(output: str) -> tuple[str, str | None] | None:
    """The exception line and innermost frame of the last Python traceback in ``output``, or None.
    Once a rank has joined its process group, torch.distributed prefixes each line of an uncaught
    exception's traceback with ``[rank<r>]: ``; that prefix is dropped."""
    lines = [_RANK_PREFIX.sub("", line) for line in output.splitlines()]
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last):")]
    if not starts:
        return None
    frame = None
    for i in range(starts[-1] + 1, len(lines)):
        line = lines[i]
        if line.startswith("  File "):
            source = lines[i + 1].strip() if i + 1 < len(lines) and lines[i + 1].startswith("    ") else ""
            frame = line.strip() + (f": {source}" if source and set(source) - set("^~ ") else "")
        elif line and not line[0].isspace():
            return line, frame
    return None


def _error(returncode: int | None, output: str, stopped: str | None) -> tuple[str, str | None]:
    if stopped is not None:
        return f"killed by the launcher, {stopped}", None
    end = _traceback_end(output)
    if end is not None:
        return end
    if returncode < 0:
        return f"killed by signal {-returncode} ({signal.Signals(-returncode).name})", None
    last = next((line for line in reversed(output.splitlines()) if line.strip()), "")
    return f"exit status {returncode}, no Python traceback; last output line: {last!r}", None


def rank_failures(ranks: list[Rank]) -> list[dict]:
    """Every rank that did not exit 0, JSON-able, the first to fail on its own leading (the cause;
    ``first`` True), then in the order they ended. ``error``: the rank's exception line (``Type:
    message``) or how its process ended without one; ``raised_at``: the innermost frame of its
    traceback (``File "...", line N, in f: source``), None without one."""
    failed = sorted((r for r, rank in enumerate(ranks) if rank.returncode != 0),
                    key=lambda r: (ranks[r].stopped is not None, ranks[r].ended_s))
    first = next((r for r in failed if ranks[r].stopped is None), None)
    failures = []
    for r in failed:
        error, raised_at = _error(ranks[r].returncode, ranks[r].output, ranks[r].stopped)
        failures.append({"rank": r, "error": error, "raised_at": raised_at, "first": r == first})
    return failures


def rank_summaries(ranks: list[Rank]) -> list[dict]:
    """Per rank, JSON-able: exit status, when it ended, why the launcher stopped it, its output's tail."""
    return [{"returncode": r.returncode, "ended_s": r.ended_s, "stopped": r.stopped, "tail": r.output[-2000:]}
            for r in ranks]


def describe_failures(failures: list[dict], indent: str = "  ") -> list[str]:
    """Lines for :func:`rank_failures`' entries: the rank, its error and where it was raised."""
    lines = []
    for f in failures:
        lines.append(f"{indent}rank {f['rank']}{' failed first' if f['first'] else ''}: {f['error']}")
        if f["raised_at"]:
            lines.append(f"{indent}  raised at {f['raised_at']}")
    return lines
