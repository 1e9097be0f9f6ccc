"""diffusers' own ``enable_parallelism(ContextParallelConfig(ulysses_degree=N))`` under ``flowlock.patch``
on gloo subprocesses, the tiny H3 (2 heads for N = 2, 4 heads for N = 4).

For S = 24 (divisible), 25 (not) and 3 (S < N at N = 4: a zero-row shard), every rank's outputs,
latent gradients and the gradients of the parameters outside the sharded region are bitwise those
of one process; the sharded region's gradients are the rank-order fold of the per-rank partials
(the same on every rank) and repeat bitwise. The same checks catch a planted row-count-dependent
linear (both degrees) and a planted naive all-reduce in place of the fold (N = 4; at N = 2 a
two-term sum is the same either way). N = 2 also checks the refusals (ring, patch before
``enable_parallelism``, ranks holding different packings of the same S) and gradient-checkpointed
blocks; N = 4 refuses a degree that does not divide the heads.
"""

import pytest
from parallel_launch import assert_all_ok, launch


@pytest.mark.parametrize("world", [2, 4])
def test_ulysses_equals_one_process(world):
    ranks, _ = launch(world, "ulysses")
    for out in assert_all_ok(ranks):
        for seq in (24, 25, 3):
            assert f"Ulysses {world}, S={seq}," in out
        assert "planted row-count-dependent linear caught" in out
        if world == 4:
            assert f"planted naive all-reduce of bf16/fp32 partials over {world} ranks caught" in out
        else:
            assert "ring, patch order and a per-rank layout mismatch refused" in out
            assert "gradient-checkpointed blocks equal one process" in out


@pytest.mark.parametrize("world", [2, 4])
def test_exact_parameter_gradients_equal_one_process(world):
    ranks, _ = launch(world, "ulysses_exact")
    for out in assert_all_ok(ranks):
        for seq in (24, 25, 3):
            assert f"Ulysses {world} exact, S={seq}, rank" in out and "parameter gradients equal one process" in out
        assert f"Ulysses {world} exact, S=25, checkpointed, rank" in out
        assert "the default fold differs from one process in" in out
        assert "an audit fallback under exact parameter gradients refused" in out
        for seq in (25, 3):
            assert f"Ulysses {world} exact with LoRA, S={seq}, rank" in out and "LoRA factor gradients equal" in out
        assert "the default fold differs from one process in" in out and "LoRA factor gradients" in out


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_every_wrapped_op_gives_one_process_replicated_gradients(backend):
    # op by op, so the interpreted Triton kernels stay fast; the whole model runs on the reference above
    ranks, _ = launch(2, "exact_ops", args=[backend])
    for out in assert_all_ok(ranks):
        for seq in (25, 3):
            assert f"every wrapped op equal one process on {backend}, S={seq}, 2 ranks" in out


def test_fsdp2_dp2_times_ulysses2_equals_one_process():
    ranks, _ = launch(4, "fsdp_ulysses")
    for out in assert_all_ok(ranks):
        for seq in (24, 25):
            assert f"FSDP2 dp 2 x Ulysses 2, S={seq}," in out
        assert "an FSDP2 mesh spanning the Ulysses peers refused" in out
