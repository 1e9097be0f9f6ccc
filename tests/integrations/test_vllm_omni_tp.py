"""vLLM-Omni tensor and Ulysses parallel on flowlock: every rank of TP 2, 4, 8 and Ulysses 2, 4
computes TP = 1's bits.

The real vLLM-Omni 0.30.0 ``MiniMaxH3DiTModel`` is built in vLLM's own distributed environment
(``initialize_model_parallel(tensor_model_parallel_size=N)``, gloo, one forked process per rank) with
its diffusers weights sharded by vLLM-Omni's ``load_weights``, and installed strict on every rank
(``vllm_omni_tp_jobs.py``). Its outputs for four forwards (padded, unpadded, keyframe-conditioned and
three packed requests) are compared with ``torch.equal`` against TP = 1 and against diffusers +
flowlock. The same comparison catches a planted stock row-parallel linear (partial GEMMs summed by an
all-reduce). TP = 1 builds no tensor-parallel object and issues no collective. Invalid layouts are
refused at install, and a rank that raises, dies or stalls ends every rank with an error. A trainer's
peft LoRA synced into vLLM-Omni's own LoRA layers at TP 2 and 4 gives the trainer's bits. Ulysses
runs in vLLM-Omni's own diffusion groups with its ``_sp_plan`` hooks applied, the token refiner
replicated.
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from engine_inputs import make_request, request_rows
from vllm_omni_tp_jobs import CASES, PG_TIMEOUT_S, TP_CONFIG

from flowlock.integrations.vllm_omni.minimax_h3.sequence_parallel import NativeUlysses
from flowlock.integrations.vllm_omni.minimax_h3.tensor_parallel import layout_widths
from flowlock.parallel.tensor_parallel import check_divisible
from flowlock.testing import assert_bitwise_equal

HERE = Path(__file__).resolve().parent
DEGREES = (2, 4, 8)
ULYSSES = (2, 4)
FAULT_JOBS = ("failing", "killed", "stuck")
LORA_DEGREES = (2, 4)
JOBS = ("tp1", *(f"tp{n}" for n in DEGREES), *(f"sp{n}" for n in ULYSSES), *(f"lora{n}" for n in LORA_DEGREES),
        "disagree", *FAULT_JOBS)
JOB_DEADLINE_S = 300


def _launch(root: Path, jobs: tuple[str, ...]) -> Path:
    """Run ``jobs`` in one launcher process (vLLM is imported once); return their output folder."""
    env = dict(os.environ, FLOWLOCK_JOB_DEADLINE_S=str(JOB_DEADLINE_S),
               PYTHONPATH=os.pathsep.join([str(HERE.parents[1] / "src"), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(HERE / "vllm_omni_tp_jobs.py"), str(root), *jobs], env=env,
                          capture_output=True, text=True, timeout=JOB_DEADLINE_S * len(jobs))
    assert done.returncode == 0, done.stderr[-4000:]
    return root


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("vllm_omni_tp"), JOBS)


@pytest.mark.slow
def test_interpreted_kernels_on_tp2_ranks_give_tp1_bits(tmp_path):
    # The Triton kernels a GPU rollout runs, interpreted (about 2.5 min of CPU), on vLLM's weight
    # shards (AdaLN rows, fc1 halves, 96 / N output columns) and 13 / 12 row shards of 25 rows.
    root = _launch(tmp_path, ("tp1i", "tp2i"))
    (reference,) = _ranks(root, "tp1i")
    for rank, saved in enumerate(_ranks(root, "tp2i")):
        assert saved["backends"] == reference["backends"] == ["triton"]
        assert_bitwise_equal((saved["unpadded.video"], saved["unpadded.audio"]),
                             (reference["unpadded.video"], reference["unpadded.audio"]), f"interpreted rank {rank}")


def _status(root: Path, job: str) -> dict:
    return json.loads((root / job / "status.json").read_text())


def _log(root: Path, job: str, rank: int) -> str:
    return (root / job / f"rank{rank}.log").read_text()


def _ranks(root: Path, job: str) -> list[dict]:
    status = _status(root, job)
    for rank, code in enumerate(status["exitcodes"]):
        assert code == 0, f"{job} rank {rank} ended with {code}:\n{_log(root, job, rank)[-4000:]}"
    return [torch.load(root / job / f"rank{r}.pt") for r in range(len(status["exitcodes"]))]


def _outputs(saved: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    return {case: (saved[f"{prefix}{case}.video"], saved[f"{prefix}{case}.audio"]) for case in CASES}


def _mismatches(outputs: dict, reference: dict) -> list[str]:
    """The cases whose outputs are not bitwise the reference's (the harness every layout goes through)."""
    bad = []
    for case, got in outputs.items():
        try:
            assert_bitwise_equal(got, reference[case], case)
        except AssertionError:
            bad.append(case)
    return bad


def _assert_diffusers_bits(saved: dict, trainer: dict, what: str) -> None:
    """Each request's rows of every case equal diffusers + flowlock on that request alone."""
    for case, specs in CASES.items():
        requests = [make_request(**s) for s in specs]
        video, audio = _outputs(saved)[case]
        for i in range(len(requests)):
            assert_bitwise_equal(request_rows(requests, i, video, audio),
                                 (trainer[f"diffusers.{case}.{i}.video"], trainer[f"diffusers.{case}.{i}.audio"]),
                                 f"{case} request {i}: {what} vs diffusers")


def test_degree_one_is_the_plain_adapter(jobs):
    (tp1,) = _ranks(jobs, "tp1")
    assert tp1["tensor_parallel_degree"] == 1
    assert not any(tp1["collectives.install"].values()), tp1["collectives.install"]
    assert not any(tp1["collectives.forwards"].values()), tp1["collectives.forwards"]
    _assert_diffusers_bits(tp1, tp1, "vLLM-Omni TP = 1")


@pytest.mark.parametrize("degree", DEGREES)
def test_every_rank_gives_tp1_bits(jobs, degree):
    (tp1,) = _ranks(jobs, "tp1")
    reference = _outputs(tp1)
    ranks = _ranks(jobs, f"tp{degree}")
    assert len(ranks) == degree
    for rank, saved in enumerate(ranks):
        assert saved["tensor_parallel_degree"] == degree
        assert _mismatches(_outputs(saved), reference) == [], f"TP {degree} rank {rank}"
        _assert_diffusers_bits(saved, tp1, f"TP {degree} rank {rank}")
        # no float crosses ranks through a reduction: only all-to-alls and all-gathers, and two
        # all-to-alls (out_proj, fc2) per DiT and refiner block per forward
        forwards = saved["collectives.forwards"]
        blocks = TP_CONFIG["num_layers"] + TP_CONFIG["num_refiner_layers"]
        assert forwards["all_to_all_single"] == 2 * blocks * len(CASES), forwards
        assert {k for k, v in forwards.items() if v} == {"all_to_all_single", "all_gather"}, forwards
        assert not saved["removed_attribute"]


@pytest.mark.parametrize("degree", LORA_DEGREES)
def test_synced_lora_at_tp_gives_the_trainer_bits(jobs, degree):
    # vLLM-Omni's own LoRA layers at TP = N, the factors sliced by vLLM per rank (lora_B by output rows on
    # q/k/v and fc1, lora_A by K blocks on out_proj and fc2): every request's rows on every rank equal
    # the trainer's diffusers + peft strict forward of that request alone
    ranks = _ranks(jobs, f"lora{degree}")
    assert len(ranks) == degree
    for rank, saved in enumerate(ranks):
        assert saved["lora_layers"] == 4 * (TP_CONFIG["num_layers"] + TP_CONFIG["num_refiner_layers"])
        assert saved["lora_tp_size"] == [degree]
        _assert_diffusers_bits(saved, saved, f"LoRA at TP {degree} rank {rank}")


@pytest.mark.parametrize("degree", DEGREES)
def test_planted_naive_all_reduce_is_caught(jobs, degree):
    reference = _outputs(_ranks(jobs, "tp1")[0])
    for rank, saved in enumerate(_ranks(jobs, f"tp{degree}")):
        assert _mismatches(_outputs(saved, "planted."), reference) == sorted(CASES, key=list(CASES).index), \
            f"TP {degree} rank {rank}: the stock K-split sum went unnoticed"


@pytest.mark.parametrize("degree", ULYSSES)
def test_every_ulysses_rank_gives_tp1_bits(jobs, degree):
    (tp1,) = _ranks(jobs, "tp1")
    reference = _outputs(tp1)
    ranks = _ranks(jobs, f"sp{degree}")
    assert len(ranks) == degree
    for rank, saved in enumerate(ranks):
        assert saved["ulysses_degree"] == degree
        assert saved["sp_hooks"] == ["local_sp_prepare", "sp_gather", "sp_prepare"]
        assert _mismatches(_outputs(saved), reference) == [], f"Ulysses {degree} rank {rank}"
        _assert_diffusers_bits(saved, tp1, f"Ulysses {degree} rank {rank}")
        # two all-to-alls per DiT block per forward and none for the refiner (its text stays replicated)
        forwards = saved["collectives.forwards"]
        assert forwards["all_to_all_single"] == 2 * TP_CONFIG["num_layers"] * len(CASES), forwards
        assert {k for k, v in forwards.items() if v} == {"all_to_all_single", "all_gather"}, forwards


@pytest.mark.parametrize("degree", ULYSSES)
def test_refiner_through_the_all_to_all_is_caught(jobs, degree):
    # the planted stock-diffusers handling: each rank's replicated text goes through the exchange as if
    # it were a shard, and attends over its N copies. One request's rows can keep their bits on a CPU
    # (the reference attention over exact copies of its keys rounds the same); packed requests cannot
    # (their documents mix), so the packed forward is where the harness must see it.
    reference = _outputs(_ranks(jobs, "tp1")[0])
    for rank, saved in enumerate(_ranks(jobs, f"sp{degree}")):
        assert "packed" in _mismatches(_outputs(saved, "planted."), reference), f"Ulysses {degree} rank {rank}"


def test_ring_sequence_parallelism_is_refused_at_install():
    model = SimpleNamespace(parallel_config=SimpleNamespace(ulysses_degree=2, ring_degree=2))
    with pytest.raises(ValueError, match=r"ring sequence parallelism \(ring_degree 2\) is not on the strict path"):
        NativeUlysses.for_model(model)


def test_invalid_layouts_are_refused_with_the_reason(fresh_native):
    h3 = {"attention heads": 56, "FFN width": 14336, "hidden size": 5376}
    for degree in (1, 2, 4, 7, 8):
        check_divisible(degree, h3)
    with pytest.raises(ValueError, match=r"degree 3 .*FFN width 14336 % 3 != 0"):
        check_divisible(3, h3)
    with pytest.raises(ValueError, match=r"attention heads 56 % 16 != 0"):
        check_divisible(16, h3)
    widths = layout_widths(fresh_native)
    check_divisible(2, widths)
    with pytest.raises(ValueError, match=r"attention heads 2 % 4 != 0"):
        check_divisible(4, widths)


def test_ranks_that_disagree_on_the_layout_are_refused_at_install(jobs):
    assert _status(jobs, "disagree")["exitcodes"] == [1, 1]
    for rank in range(2):
        log = _log(jobs, "disagree", rank)
        assert f"rank {rank}: ValueError" in log and "disagree on the vLLM-Omni H3 layout" in log, log[-3000:]
        assert "rank 0: [2, 2, 1," in log and "rank 1: [2, 1, 1," in log, log[-3000:]


@pytest.mark.parametrize("job", FAULT_JOBS)
def test_a_failing_rank_ends_every_rank_with_an_error(jobs, job):
    status = _status(jobs, job)
    survivor, faulty = status["exitcodes"]
    assert survivor == 1 and faulty == {"failing": 1, "killed": -9, "stuck": 1}[job], status
    log = _log(jobs, job, 0)
    line = next(line for line in log.splitlines() if line.startswith("rank 0: CollectiveError after"))
    assert "tensor-parallel K-sharded linear" in line, line
    waited = float(line.split("after ")[1].split(" s")[0])
    if job == "stuck":
        # the survivor waits one process-group timeout, not the stalled rank's 4
        assert PG_TIMEOUT_S <= waited < 4 * PG_TIMEOUT_S, line
        assert "rank 1: CollectiveError after" in _log(jobs, job, 1)
    assert status["wall_s"] < JOB_DEADLINE_S
