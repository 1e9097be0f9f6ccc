"""A rank that is killed, raises, or stops responding ends every rank of a job with an error within a
bounded time, never a hang, and the failing rank is named.

Inside a Ulysses job (gloo, 2 subprocess ranks, the tiny H3; rank 1 fails on entering the second
transformer block, rank 0 is then inside that block's all-to-all) the survivors' next flowlock
collective raises CollectiveError naming the collective, the rank and the group size. A rank that
fails before the rendezvous is seen by the launcher through its process exit: the ranks waiting for
it are ended a grace period later, not at the store timeout. ``flowlock check --layout`` prints the
rank that failed first, its exception and where it was raised.
"""

import functools
import json

import pytest
from parallel_launch import WORKER, launch

import flowlock.validate.layout as check_module
from flowlock.cli import main
from flowlock.validate.layout_launch import GRACE_S, Rank, rank_failures
from flowlock.validate.layout_launch import launch as flowlock_launch

PG_TIMEOUT_S = 5.0
STORE_TIMEOUT_S = 60.0  # flowlock check --layout's process-group (and rendezvous) timeout


@pytest.mark.parametrize("scenario", ["killed_rank", "failing_rank"])
def test_dead_rank_ends_every_rank_with_an_error(scenario):
    # a grace as long as the deadline: the survivor must end on its own, not be ended by the launcher
    ranks, wall = launch(2, scenario, timeout=120.0, grace=120.0)
    survivor, faulty = ranks
    assert survivor.returncode not in (None, 0), survivor.output[-3000:]
    assert "rank 0: CollectiveError after" in survivor.output, survivor.output[-3000:]
    assert "Ulysses all-to-all (sequence to heads) failed on rank 0 of a group of 2" in survivor.output
    assert faulty.returncode == (-9 if scenario == "killed_rank" else 1), faulty.output[-3000:]
    assert wall < 120.0
    first = rank_failures(ranks)[0]
    assert first["rank"] == 1 and first["first"], rank_failures(ranks)
    if scenario == "killed_rank":
        assert first["error"] == "killed by signal 9 (SIGKILL)" and first["raised_at"] is None
    else:
        assert first["error"] == "RuntimeError: planted failure on rank 1"
        assert first["raised_at"].startswith(f'File "{WORKER}", line ')
        assert first["raised_at"].endswith('in fail: raise RuntimeError("planted failure on rank 1")')


def test_stuck_rank_ends_every_rank_within_the_timeout():
    stuck_s = 4 * PG_TIMEOUT_S
    # the grace outlasts the sleep, so the stuck rank wakes into the broken group instead of being killed
    ranks, wall = launch(2, "stuck_rank", timeout=120.0, pg_timeout=PG_TIMEOUT_S, grace=2 * stuck_s,
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


@pytest.mark.parametrize("when", ["before_rendezvous", "after_rendezvous"])
def test_check_names_the_failing_rank_and_ends_at_once(when, monkeypatch, capsys, tmp_path):
    """``flowlock check --layout ulysses=2`` with the test worker, rank 1 planted to raise ``when``."""
    monkeypatch.setenv("FLOWLOCK_PLANTED_FAILURE", f"{when}:1")
    monkeypatch.setattr(check_module, "launch", lambda world, scenario, **kw: flowlock_launch(
        world, scenario, WORKER, pg_timeout=STORE_TIMEOUT_S, **kw))
    report_path = tmp_path / "report.json"
    assert main(["check", "--layout", "ulysses=2", "--json", str(report_path)]) == 1
    out = capsys.readouterr().out
    assert "flowlock check --layout ulysses=2: FAIL (2 gloo ranks" in out, out
    message = f"planted failure on rank 1 {when.replace('_', ' ')}"
    assert f"  rank 1 failed first: RuntimeError: {message}\n" in out, out
    assert f'    raised at File "{WORKER}", line ' in out, out
    assert "in _planted_failure: raise RuntimeError(" in out, out
    assert "  rank 0: " in out, out  # ended after rank 1: by its own error or by the launcher
    report = json.loads(report_path.read_text())
    failed_at = report["ranks"][1]["ended_s"]
    after = max(r["ended_s"] for r in report["ranks"]) - failed_at
    # rank 0 waits in the rendezvous (before) or in a collective (after) for the dead rank 1
    assert after <= GRACE_S + 2.0 < STORE_TIMEOUT_S / 4, report["ranks"]
    if when == "before_rendezvous":
        assert report["ranks"][0]["returncode"] is None, report["ranks"][0]
        assert f"  rank 0: killed by the launcher, still running {GRACE_S:g} s after rank 1 failed" in out, out


_SLEEPER = """\
import os, sys, time
if sys.argv[1] == "rank_1_fails" and os.environ["RANK"] == "1":
    raise RuntimeError("rank 1 gives up")
time.sleep(120)
"""


def test_launcher_ends_the_other_ranks_a_grace_after_one_fails_and_all_at_the_deadline(tmp_path):
    worker = tmp_path / "sleeper.py"
    worker.write_text(_SLEEPER)
    ranks, wall = flowlock_launch(3, "rank_1_fails", worker, timeout=100.0, grace=1.0)
    assert [r.returncode for r in ranks] == [None, 1, None] and wall < 30.0, ranks
    assert {r.stopped for r in ranks} == {None, "still running 1 s after rank 1 failed"}
    assert all(0.9 <= r.ended_s - ranks[1].ended_s < 5.0 for r in (ranks[0], ranks[2])), ranks
    assert rank_failures(ranks)[0] == {"rank": 1, "error": "RuntimeError: rank 1 gives up", "first": True,
                                       "raised_at": f'File "{worker}", line 3, in <module>: '
                                                    'raise RuntimeError("rank 1 gives up")'}
    ranks, wall = flowlock_launch(2, "all_sleep", worker, timeout=2.0)
    assert [r.returncode for r in ranks] == [None, None] and wall < 30.0, ranks
    assert {r.stopped for r in ranks} == {"still running at the 2 s deadline"}


_CHAINED = """\
rank 0: starting
Traceback (most recent call last):
  File "/x/ops.py", line 10, in all_to_all
    work.wait()
RuntimeError: Connection closed by peer

The above exception was the direct cause of the following exception:

[rank0]: Traceback (most recent call last):
[rank0]:   File "/x/worker.py", line 3, in <module>
[rank0]:     main()
[rank0]:   File "/x/ulysses.py", line 42, in exchange
[rank0]:     raise CollectiveError(f"{what} failed") from err
[rank0]:     ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
[rank0]: flowlock.parallel.errors.CollectiveError: all-to-all failed
[rank0]:   on rank 0 of a group of 2
"""


def test_failures_name_the_last_exception_and_its_innermost_frame():
    ranks = [Rank(1, _CHAINED, 3.0), Rank(0, "rank 1 ok\n", 1.0), Rank(-6, "terminate called\n", 2.0),
             Rank(None, "waiting\n", 9.0, stopped="still running 5 s after rank 2 failed"), Rank(3, "", 2.5)]
    failures = rank_failures(ranks)
    assert [f["rank"] for f in failures] == [2, 4, 0, 3]
    assert [f["first"] for f in failures] == [True, False, False, False]
    assert failures[0]["error"] == "killed by signal 6 (SIGABRT)"
    assert failures[1]["error"] == "exit status 3, no Python traceback; last output line: ''"
    assert failures[2] == {"rank": 0, "error": "flowlock.parallel.errors.CollectiveError: all-to-all failed",
                           "raised_at": 'File "/x/ulysses.py", line 42, in exchange: '
                                        'raise CollectiveError(f"{what} failed") from err', "first": False}
    assert failures[3]["error"] == "killed by the launcher, still running 5 s after rank 2 failed"


def test_check_refuses_a_layout_it_does_not_serve_before_any_rank(monkeypatch, capsys):
    monkeypatch.setattr(check_module, "launch", functools.partial(pytest.fail, "a rank was launched"))
    assert main(["check", "--layout", "dp=2"]) == 2
    assert "layout 'dp=2' has no check here; supported: ulysses=2, ulysses=4" in capsys.readouterr().err
