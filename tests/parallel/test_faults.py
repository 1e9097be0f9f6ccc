"""A rank that is killed, raises, or stops responding ends every rank of a Ulysses job with an error
within a bounded time, never a hang: the survivors' next flowlock collective raises CollectiveError
naming the collective, the rank and the group size (gloo, 2 subprocess ranks, the tiny H3; rank 1
fails on entering the second transformer block, rank 0 is then inside that block's all-to-all)."""

import pytest
from parallel_launch import launch

PG_TIMEOUT_S = 5.0


@pytest.mark.parametrize("scenario", ["killed_rank", "failing_rank"])
def test_dead_rank_ends_every_rank_with_an_error(scenario):
    ranks, wall = launch(2, scenario, timeout=120.0)
    survivor, faulty = ranks
    assert survivor.returncode not in (None, 0), survivor.output[-3000:]
    assert "rank 0: CollectiveError after" in survivor.output, survivor.output[-3000:]
    assert "Ulysses all-to-all (sequence to heads) failed on rank 0 of a group of 2" in survivor.output
    assert faulty.returncode == (-9 if scenario == "killed_rank" else 1), faulty.output[-3000:]
    assert wall < 120.0


def test_stuck_rank_ends_every_rank_within_the_timeout():
    stuck_s = 4 * PG_TIMEOUT_S
    ranks, wall = launch(2, "stuck_rank", timeout=120.0, pg_timeout=PG_TIMEOUT_S,
                         extra_env={"FLOWLOCK_STUCK_S": str(stuck_s)})
    survivor, stuck = ranks
    assert survivor.returncode not in (None, 0), survivor.output[-3000:]
    line = next(line for line in survivor.output.splitlines() if line.startswith("rank 0: CollectiveError after"))
    waited = float(line.split("after ")[1].split(" s")[0])
    # The forward up to the stuck block takes well under a second; the survivor waits one timeout.
    assert PG_TIMEOUT_S <= waited < stuck_s, line
    # The stuck rank wakes into a group whose peer is gone and ends with an error too.
    assert stuck.returncode not in (None, 0), stuck.output[-3000:]
    assert "rank 1: CollectiveError after" in stuck.output, stuck.output[-3000:]
