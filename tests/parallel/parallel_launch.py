"""Launch the test worker (``parallel_worker.py``) as a gloo job, through flowlock's own launcher."""

from __future__ import annotations

from pathlib import Path

from flowlock.validate.layout_launch import GRACE_S, Rank
from flowlock.validate.layout_launch import launch as _launch

WORKER = Path(__file__).resolve().parent / "parallel_worker.py"


def launch(world: int, scenario: str, timeout: float = 240.0, pg_timeout: float = 60.0, grace: float = GRACE_S,
           extra_env: dict | None = None, args: list[str] = ()) -> tuple[list[Rank], float]:
    """``parallel_worker.py SCENARIO ARGS...`` on ``world`` ranks; ranks still running at ``timeout``, or
    ``grace`` s after another rank failed, are killed and reported with ``returncode`` None (a hang
    fails the test, never hangs it)."""
    return _launch(world, scenario, WORKER, timeout=timeout, pg_timeout=pg_timeout, grace=grace, extra_env=extra_env,
                   args=list(args))


def assert_all_ok(ranks: list[Rank]) -> list[str]:
    """Every rank exited 0 and printed its ``rank <r> ok`` line; return their outputs."""
    for rank, r in enumerate(ranks):
        assert r.returncode == 0, f"rank {rank} ended with {r.returncode}:\n{r.output[-4000:]}"
        assert f"rank {rank} ok" in r.output, r.output[-4000:]
    return [r.output for r in ranks]
