"""The suites ``flowlock check`` runs, each with one line saying what it covers.

Every suite takes a diffusers H3 model and returns a JSON-able dict with ``passed``; a suite that
raises has failed, and :func:`run_suites` records why instead of stopping the others.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from flowlock.validate.batch_trace import BATCH, POSITION, run_traces
from flowlock.validate.chain import chain_replay
from flowlock.validate.consistency import run_consistency
from flowlock.validate.report import Table

CONSISTENCY_SAMPLES, CONSISTENCY_STEPS = 3, 2


@dataclass(frozen=True)
class Suite:
    name: str
    covers: str
    run: Callable[[object], dict]


def _chain(model) -> dict:
    chain = chain_replay(model)
    return {"passed": chain["ok"], "first_drifting_stage": chain["first_drifting_stage"]}


def _trace(model) -> dict:
    div = run_traces(model)["strict"]["divergence"]
    return {"passed": div is None, "divergence": div}


def _consistency(model) -> dict:
    strict = run_consistency(model, n_samples=CONSISTENCY_SAMPLES, steps=CONSISTENCY_STEPS, mode="strict")
    return {"passed": strict["bitwise_equal"], "max_abs_dlogp": strict["max_abs_dlogp"]}


SUITES = (
    Suite("chain", "the conditioning chain (timestep -> AdaLN -> modulation -> final norm) through flowlock's ops: "
          "the same bits every run and alone vs in a batch, forward and gradients", _chain),
    Suite("trace_strict", f"the whole strict H3 forward: every module's output for one sample the same bits alone "
          f"and at position {POSITION} of a batch of {BATCH}", _trace),
    Suite("rl_consistency_strict", f"an RL step under strict: {CONSISTENCY_SAMPLES} samples rolled out in one batch "
          f"for {CONSISTENCY_STEPS} CPS steps, replayed one at a time in reversed order: every velocity and "
          "log-prob the rollout's bits", _consistency),
)


def run_suites(model) -> dict[str, dict]:
    """Every suite of :data:`SUITES` on ``model``, by name; each result also carries ``covers``."""
    results = {}
    for suite in SUITES:
        try:
            result = suite.run(model)
        except Exception as err:  # a suite that cannot run is a failed check, reported with its cause
            result = {"passed": False, "error": f"{type(err).__name__}: {err}"}
        results[suite.name] = {"covers": suite.covers, **result}
    return results


def suites_table(results: dict[str, dict], title: str) -> Table:
    """:func:`run_suites` ``results`` as a table: PASS / FAIL, the suite, what it covers (and why it
    could not run, if it could not)."""
    rows = tuple(("PASS" if r["passed"] else "FAIL", name, r["covers"] + (f" ({r['error']})" if "error" in r else ""))
                 for name, r in results.items())
    return Table(title, ("result", "suite", "what it covers"), rows)
