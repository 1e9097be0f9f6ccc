"""``flowlock check --layout``: the suite of one parallel layout on gloo subprocesses of this machine (tiny H3).

:func:`check_layout` runs the layout's scenario (:data:`flowlock.validate.layout_spec.PARALLEL_LAYOUTS`)
on its world of ranks (:func:`flowlock.validate.layout_launch.launch`) and reports it; :func:`describe`
says PASS, or which rank failed first, with what exception, raised where.
"""

from __future__ import annotations

from flowlock.validate.layout_launch import describe_failures, launch, rank_failures, rank_summaries
from flowlock.validate.layout_spec import parse_parallel_layout


def check_layout(spec: str, timeout: float = 600.0) -> dict:
    """Run the suite of the parallel layout ``spec``; a JSON-able report: ``passed``, per rank its
    exit status, when it ended and its output's tail, and ``failures`` (:func:`rank_failures`).
    Raises ValueError, before any rank starts, for a layout ``check`` does not serve, naming those it does."""
    layout = parse_parallel_layout(spec, "check")
    ranks, wall = launch(layout.world, layout.check, timeout=timeout)
    silent = [r for r, rank in enumerate(ranks) if rank.returncode == 0 and f"rank {r} ok" not in rank.output]
    failures = rank_failures(ranks)
    failures += [{"rank": r, "error": f"exited 0 without its 'rank {r} ok' line", "raised_at": None, "first": False}
                 for r in silent]
    return {"passed": not failures, "layout": layout.name, "world": layout.world, "wall_s": round(wall, 1),
            "failures": failures, "ranks": rank_summaries(ranks)}


def describe(report: dict) -> str:
    """PASS or FAIL, and on FAIL each failed rank (the first to fail leading) with its exception and
    the innermost frame of its traceback."""
    lines = [f"flowlock check --layout {report['layout']}: {'PASS' if report['passed'] else 'FAIL'} "
             f"({report['world']} gloo ranks, {report['wall_s']} s)"]
    return "\n".join(lines + describe_failures(report["failures"]))
