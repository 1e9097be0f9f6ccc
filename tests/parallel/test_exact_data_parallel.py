"""Exact data parallelism under FSDP2 through ``flowlock check --layout dp=N,exact`` (gloo, tiny H3):
every parameter gradient of a step of FSDP2 DP 2 and DP 4, and of DP 2 x Ulysses 2 with exact
parameter gradients, ``torch.equal`` the one-process tree sum over the same micro-batches
(:mod:`flowlock.validate.layout_exact_dp`). At DP 4 FSDP2's own reduction is shown to differ, so the
comparison can tell the two apart (at DP 2 with two micro-batches per rank every order is the tree).
The hierarchical (within, then across nodes) reduce-scatter gives the flat tree's bits at 6 and 8 ranks."""

import json

import pytest
from parallel_launch import assert_all_ok, launch

from flowlock.cli import main


@pytest.mark.parametrize("world", [2, 4])
def test_exact_data_parallel_gives_one_process_parameter_gradients(world, tmp_path, capsys):
    report_path = tmp_path / "report.json"
    assert main(["check", "--layout", f"dp={world},exact", "--json", str(report_path)]) == 0
    assert "PASS" in capsys.readouterr().out
    report = json.loads(report_path.read_text())
    for rank, result in enumerate(report["ranks"]):
        tail = result["tail"]
        assert f"rank {rank} ok" in tail
        if world == 2:
            assert f"FSDP2 DP 2 exact, 2 micro-batches per rank, rank {rank}: all 52 parameter gradients equal" in tail
        else:
            assert f"FSDP2 DP 2 x Ulysses 2 exact, rank {rank}: all 52 parameter gradients equal one process" in tail
            assert f"FSDP2 DP 4 exact, nodes of 2 (within, then across), rank {rank}: all 52" in tail
            assert f"rank {rank}: FSDP2's own reduction differs from one process in" in tail
            assert f"rank {rank}: exact data parallelism on an HSDP mesh refused" in tail


@pytest.mark.parametrize(("world", "node_sizes"), [(8, ("2", "4")), (6, ("2",))])
def test_hierarchical_tree_reduce_scatter_gives_the_flat_bits(world, node_sizes):
    ranks, _ = launch(world, "tree_reduce_scatter", args=list(node_sizes))
    for out in assert_all_ok(ranks):
        assert "hierarchical tree reduce-scatter" in out and f"over {world} ranks" in out
