"""Launch a gloo job of ``world`` Python subprocesses on this machine and collect what each printed."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"


@dataclass
class Rank:
    returncode: int | None
    output: str


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, scenario: str, timeout: float = 240.0, pg_timeout: float = 60.0,
           extra_env: dict | None = None) -> tuple[list[Rank], float]:
    """Run ``parallel_worker.py <scenario>`` on ``world`` gloo ranks; return each rank's exit code and
    output, and the wall time until the last rank ended. Ranks still running at ``timeout`` are killed
    and reported with ``returncode`` None: a hang is a test failure, never a hung test."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(world),
               PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
               FLOWLOCK_PG_TIMEOUT=str(pg_timeout), OMP_NUM_THREADS="1", **(extra_env or {}))
    start = time.monotonic()
    procs = [subprocess.Popen([sys.executable, str(HERE / "parallel_worker.py"), scenario],
                              env=dict(env, RANK=str(rank)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for rank in range(world)]
    ranks = []
    for proc in procs:
        left = max(0.1, timeout - (time.monotonic() - start))
        try:
            out, _ = proc.communicate(timeout=left)
            ranks.append(Rank(proc.returncode, out))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            ranks.append(Rank(None, out))
    return ranks, time.monotonic() - start


def assert_all_ok(ranks: list[Rank]) -> list[str]:
    """Every rank exited 0 and printed its ``rank <r> ok`` line; return their outputs."""
    for rank, r in enumerate(ranks):
        assert r.returncode == 0, f"rank {rank} ended with {r.returncode}:\n{r.output[-4000:]}"
        assert f"rank {rank} ok" in r.output, r.output[-4000:]
    return [r.output for r in ranks]
