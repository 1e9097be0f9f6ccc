"""The harnesses themselves: each must catch a planted failure, or its green means nothing."""

import itertools

import pytest
import torch

from flowlock.config import LaunchConfig, launch_config, register
from flowlock.testing import (
    assert_batch_invariant,
    assert_bitwise_equal,
    assert_raise_before_launch,
    assert_repeatable,
    assert_within_budget,
    batch_invariance_failures,
    bitwise_equal,
    golden_budget,
    repeat_failures,
)


def row_sums(x):
    return x.sum(dim=-1, keepdim=True)


def batch_dependent_row_sums(x):
    # Planted defect: the reduction is split at a point that depends on the batch size.
    split = 1 + x.shape[0] % 5
    return (x[:, :split].sum(-1) + x[:, split:].sum(-1)).unsqueeze(-1)


def test_invariance_harness_passes_a_row_pure_function():
    pool = torch.randn(16, 37, dtype=torch.float32)
    assert_batch_invariant(row_sums, pool)


def test_invariance_harness_catches_batch_dependent_split():
    pool = torch.randn(16, 37, dtype=torch.float32) * 1e3
    failures = batch_invariance_failures(batch_dependent_row_sums, pool)
    assert failures, "the harness missed a batch-dependent reduction order"
    with pytest.raises(AssertionError, match="not batch-invariant"):
        assert_batch_invariant(batch_dependent_row_sums, pool)


def test_repeat_harness_catches_a_fold_order_that_moves_between_calls():
    # Planted defect: each call starts its fold one element later. The values are chosen so the
    # float32 result depends on the order for certain (1e8 + 1 rounds back to 1e8), on any host:
    # every step is one IEEE scalar add, with no vectorised reduction whose split a CPU could pick.
    values = torch.tensor([1e8, 1.0, -1e8], dtype=torch.float32)
    calls = itertools.count()

    def rotating_sum():
        start = next(calls)
        acc = torch.zeros((), dtype=torch.float32)
        for i in range(values.numel()):
            acc = acc + values[(start + i) % values.numel()]
        return acc

    assert repeat_failures(rotating_sum, runs=5)
    assert_repeatable(lambda: values.sum(), runs=5)


def test_bitwise_equal_distinguishes_signed_zero_and_matches_nan():
    assert not bitwise_equal(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert bitwise_equal(torch.tensor([float("nan")]), torch.tensor([float("nan")]))
    with pytest.raises(AssertionError, match="1 of 2 elements differ"):
        assert_bitwise_equal(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 3.0]), "pair")


def test_budget_is_derived_from_baseline_error():
    golden = torch.linspace(-1, 1, 101, dtype=torch.float64)
    baseline = golden.to(torch.bfloat16).double()
    budget = golden_budget(golden, torch.bfloat16, baseline)
    assert budget > 0
    assert_within_budget(golden.float(), golden, out_dtype=torch.bfloat16, baseline=baseline)
    with pytest.raises(AssertionError, match="exceeds budget"):
        assert_within_budget(golden.float() + 0.1, golden, out_dtype=torch.bfloat16, baseline=baseline)
    with pytest.raises(AssertionError, match="NaN"):
        assert_within_budget(torch.full_like(golden, float("nan")), golden, out_dtype=torch.bfloat16)


def test_launch_config_lookup_order_and_duplicates():
    cfg = LaunchConfig((("BLOCK", 64),), num_warps=4, note="test")
    register("_test_op", "fp32", "any", cfg)
    assert launch_config("_test_op", torch.float32, "interp") is cfg
    assert launch_config("_test_op", torch.float32, "sm90", shape=(5, 7)) is cfg
    assert cfg["BLOCK"] == 64
    with pytest.raises(ValueError, match="duplicate"):
        register("_test_op", "fp32", "any", cfg)
    with pytest.raises(KeyError, match="no launch config"):
        launch_config("_test_op", torch.bfloat16, "sm90")


def test_empty_allocations_are_poisoned():
    assert torch.isnan(torch.empty(4)).all()
    assert (torch.empty(3, dtype=torch.int32) == torch.iinfo(torch.int32).min).all()


def test_raise_before_launch_catches_a_half_written_input():
    x = torch.zeros(4)

    def checks_first():
        raise ValueError("x must be positive")

    def writes_then_raises():
        x[0] = 1.0
        raise ValueError("x must be positive")

    assert_raise_before_launch([(ValueError, "positive", checks_first)], [x])
    with pytest.raises(AssertionError, match="input after a rejected call"):
        assert_raise_before_launch([(ValueError, "positive", writes_then_raises)], [x])
    with pytest.raises(pytest.fail.Exception):
        assert_raise_before_launch([(ValueError, "positive", lambda: None)], [x])
