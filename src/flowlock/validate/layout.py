"""``flowlock check --layout``: the layout suites on gloo subprocesses of this machine (tiny H3).

:func:`launch` starts ``world`` ranks of a worker (by default :mod:`flowlock.validate.layout_worker`)
and collects each rank's exit status and output, killing ranks still running at the deadline, so a
hang reports as a failure. :func:`check_layout` maps a layout spec to a job and reports it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from flowlock.parallel.ports import free_local_port

# spec -> (world size, worker scenario)
LAYOUTS = {"ulysses=2": (2, "ulysses"), "ulysses=4": (4, "ulysses"), "dp=2,ulysses=2": (4, "fsdp_ulysses"),
           "dp=2,exact": (2, "exact_dp"), "dp=4,exact": (4, "exact_dp")}


@dataclass
class Rank:
    returncode: int | None  # None: still running at the deadline, then killed
    output: str




def launch(world: int, scenario: str, worker: str | Path | None = None, timeout: float = 600.0,
           pg_timeout: float = 60.0, extra_env: dict | None = None, args: list[str] = ()
           ) -> tuple[list[Rank], float]:
    """Run ``worker SCENARIO ARGS...`` (a script path, default ``-m flowlock.validate.layout_worker``) on ``world``
    gloo ranks; return each rank's result and the wall time until the last one ended. The workers
    import the same flowlock as this process; their process group times out after ``pg_timeout`` s."""
    import flowlock

    src = str(Path(flowlock.__file__).resolve().parents[1])
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_local_port()), WORLD_SIZE=str(world),
               PYTHONPATH=os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p),
               FLOWLOCK_PG_TIMEOUT=str(pg_timeout), OMP_NUM_THREADS="1", **(extra_env or {}))
    command = [sys.executable, *(["-m", "flowlock.validate.layout_worker"] if worker is None else [str(worker)]),
               scenario, *args]
    start = time.monotonic()
    procs = [subprocess.Popen(command, env=dict(env, RANK=str(rank)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in range(world)]
    ranks = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(0.1, timeout - (time.monotonic() - start)))
            ranks.append(Rank(proc.returncode, out))
        except subprocess.TimeoutExpired:
            proc.kill()
            ranks.append(Rank(None, proc.communicate()[0]))
    return ranks, time.monotonic() - start


def check_layout(spec: str, timeout: float = 600.0) -> dict:
    """Run the suite of ``spec`` (a key of :data:`LAYOUTS`); a JSON-able report with ``passed``.
    Raises ValueError for an unknown spec, naming the supported ones."""
    key = spec.replace(" ", "")
    if key not in LAYOUTS:
        raise ValueError(f"unknown layout {spec!r}; supported: {', '.join(LAYOUTS)}")
    world, scenario = LAYOUTS[key]
    ranks, wall = launch(world, scenario, timeout=timeout)
    passed = all(r.returncode == 0 and f"rank {i} ok" in r.output for i, r in enumerate(ranks))
    return {"passed": passed, "layout": key, "world": world, "wall_s": round(wall, 1),
            "ranks": [{"returncode": r.returncode, "tail": r.output[-2000:]} for r in ranks]}
