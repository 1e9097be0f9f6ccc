"""``flowlock trace --layout``: Ulysses 2 against one process on gloo subprocesses, the tiny H3.

One job per layout runs three traced steps (forward and backward): strict at S = 25 (uneven shards),
strict with a planted row-count-dependent FFN down-projection that only rank 1's row count triggers,
and the stock diffusers path (provider) at S = 24 (stock Ulysses needs S divisible by the degree).
Strict must report no module differing; the plant must be named at ``transformer_blocks.0`` on rank 1
alone, within rank 1's full-sequence rows; the stock path must differ, and the trace must name where.
Where stock first differs depends on the host's CPU kernels: with AVX2 kernels in the token refiner's
attention forward (diffusers routes the replicated refiner rows through the all-to-all), with AVX-512
ones (MKL and ATen pick other kernels) first in ``norm_out.linear``'s backward, so the test asserts
only what holds on both.
"""

import functools
import json

import pytest
from parallel_launch import WORKER

import flowlock.validate.layout_trace as trace_module
from flowlock.validate.layout_launch import GRACE_S
from flowlock.validate.layout_trace import describe, trace_layouts


@pytest.fixture(scope="module")
def report():
    return trace_layouts("ulysses=2", runs=(("strict", 25), ("strict", 25, "ffn_rows"), ("provider", 24)),
                         worker=WORKER, timeout=240.0)


def test_strict_ulysses2_has_no_differing_module(report):
    strict = report["runs"][0]
    assert strict["divergence"] is None, describe(report)
    assert strict["records"]["forward"] >= 10 and strict["records"]["backward"] >= 10
    # the timestep embedding's gradient is each rank's partial by contract, and only that
    assert strict["partial"] == ["time_embedder"]
    assert report["ok"]


def test_planted_fault_is_named_at_its_module_and_rank(report):
    planted = report["runs"][1]
    div = planted["divergence"]
    assert div is not None and div["phase"] == "forward", describe(report)
    assert div["module"] == "transformer_blocks.0" and div["kind"] == "values"
    assert [d["rank"] for d in div["ranks"]] == [1]
    rank1 = div["ranks"][0]
    assert rank1["shard"] == [13, 25]
    assert 13 <= rank1["rows"][0] <= rank1["rows"][1] < 25 and rank1["samples"] == [0, 1]
    assert "first forward divergence at transformer_blocks.0 (record" in describe(report)


def test_stock_ulysses_path_differs_and_the_trace_names_where(report):
    stock = report["runs"][2]
    assert stock["mode"] == "provider" and stock["plant"] is None
    div = stock["divergence"]
    assert div is not None and div["phase"] in ("forward", "backward"), describe(report)
    assert div["kind"] == "values" and div["ranks"], describe(report)
    assert {d["rank"] for d in div["ranks"]} <= {0, 1}
    assert f"first {div['phase']} divergence at {div['module']} (record" in describe(report)


@pytest.mark.parametrize("argv, message", [
    (["--layout", "ulysses=3"], "unknown layout 'ulysses=3'; supported: ulysses=1, ulysses=2, ulysses=4, dp=2,"),
    (["--layout", "ulysses=2", "--against", "ulysses=2"], "--against must be one process (ulysses=1)"),
    (["--layout", "ulysses=2", "--mode", "provider", "--seq", "25"], "needs S divisible by the Ulysses degree 2"),
    (["--layout", "ulysses=2", "--rollout", "vllm-omni"], "does not combine with --rollout"),
])
def test_cli_refuses_before_any_job(argv, message, capsys):
    from flowlock.cli import main

    assert main(["trace", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_rank_failing_before_the_rendezvous_is_named_and_ends_its_job_at_once(monkeypatch, capsys, tmp_path):
    """Rank 1 of the traced layout raises before joining its group: the trace prints that rank, its
    exception and where it was raised, and its rank 0 (waiting in the rendezvous) is ended a grace
    period later instead of at the 60 s store timeout."""
    from flowlock.cli import main

    monkeypatch.setenv("FLOWLOCK_PLANTED_FAILURE", "before_rendezvous:1")
    monkeypatch.setattr(trace_module, "trace_layouts", functools.partial(trace_layouts, worker=WORKER))
    report_path = tmp_path / "report.json"
    assert main(["trace", "--layout", "ulysses=2", "--json", str(report_path)]) == 1
    out = capsys.readouterr().out
    assert "flowlock trace --layout: the layout job (ulysses=2, 2 gloo ranks) failed\n" in out, out
    assert "  rank 1 failed first: RuntimeError: planted failure on rank 1 before rendezvous\n" in out, out
    assert f'    raised at File "{WORKER}", line ' in out and "in _planted_failure: raise RuntimeError(" in out, out
    assert f"  rank 0: killed by the launcher, still running {GRACE_S:g} s after rank 1 failed" in out, out
    assert "against job" not in out  # the one-process job has no rank 1
    job = json.loads(report_path.read_text())["failed_jobs"]["layout"]
    assert job["ranks"][0]["ended_s"] - job["ranks"][1]["ended_s"] <= GRACE_S + 2.0
