"""The layout trace across vLLM-Omni TP degrees: TP = 2 against TP = 1 on the real vLLM-Omni 0.30.0
``MiniMaxH3DiTModel`` (gloo, ``vllm_omni_tp_jobs.py``'s ``trace`` job), every module output of one
strict forward compared per rank with :func:`flowlock.validate.layout_trace.compare`.

Strict: no module differs on any rank. The stock row-parallel linear (partial GEMMs all-reduced) is
named at the first module holding one, the token refiner, on both ranks; a fault planted on rank 1
alone after the last block's ``fc2`` is named at that block on rank 1 only."""

import pytest
import torch
from test_vllm_omni_tp import _launch

from flowlock.validate.layout_trace import compare


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    root = _launch(tmp_path_factory.mktemp("vllm_omni_tp_trace"), ("trace1", "trace2"))
    load = lambda job, rank: torch.load(root / job / f"rank{rank}.pt", weights_only=False)  # noqa: E731
    for job, world in (("trace1", 1), ("trace2", 2)):
        for rank in range(world):
            log = (root / job / f"rank{rank}.log").read_text()
            assert f"rank {rank} ok" in log, log[-3000:]
    return load("trace1", 0), [load("trace2", r) for r in range(2)]


def _report(traces, run):
    tp1, tp2 = traces
    return compare(tp1["clean"], [r[run] for r in tp2])


def test_strict_tp2_has_no_differing_module(traces):
    report = _report(traces, "clean")
    assert report["divergence"] is None, report["divergence"]
    assert report["records"]["forward"] >= 8


def test_stock_row_parallel_all_reduce_is_named_in_the_refiner_on_both_ranks(traces):
    div = _report(traces, "naive_all_reduce")["divergence"]
    assert div is not None and div["kind"] == "values", div
    assert div["module"].startswith("token_refiner"), div["module"]
    assert [d["rank"] for d in div["ranks"]] == [0, 1]


def test_fault_on_rank1_is_named_at_its_block_on_rank1_alone(traces):
    tp1, tp2 = traces
    last = max(int(name.split(".")[1]) for name, _ in tp1["clean"]["forward"] if name.startswith("blocks."))
    div = _report(traces, "rank1_fault")["divergence"]
    assert div is not None and div["module"] == f"blocks.{last}", div
    assert [d["rank"] for d in div["ranks"]] == [1] and div["ranks"][0]["tp_rank"] == 1
