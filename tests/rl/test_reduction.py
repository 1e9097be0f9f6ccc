"""fixed_order_mean: accurate, batch-invariant, repeatable and differentiable."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flowlock.rl.reduction import TILE, fixed_order_mean
from flowlock.testing import (
    assert_batch_invariant,
    assert_bitwise_equal,
    assert_repeatable,
    assert_within_budget,
    batch_invariance_failures,
    repeat_failures,
)


def _rows(b, n, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, n, generator=g) * torch.rand(b, 1, generator=g) * 10).to(dtype)


@pytest.mark.parametrize("n", [1, 7, 255, 257, 700])
def test_accuracy_against_float64(n):
    x = _rows(5, n)
    golden = x.double().mean(dim=1)
    # Baseline: the provider's float32 mean.
    assert_within_budget(fixed_order_mean(x), golden, baseline=x.mean(dim=1), what=f"n={n}")


@pytest.mark.parametrize("n", [1, 33, 513])
def test_batch_invariant(n):
    assert_batch_invariant(lambda x: fixed_order_mean(x), _rows(16, n, seed=n))


def test_harness_catches_a_batch_dependent_split():
    def planted(x):
        # The tile size follows the batch size: a different summation order for other batches.
        tile = 64 if x.shape[0] > 2 else 256
        b, n = x.shape
        parts = [x[:, i:i + tile].sum(dim=1) for i in range(0, n, tile)]
        return torch.stack(parts, 1).sum(1) / n

    assert batch_invariance_failures(planted, _rows(16, 513, seed=3))


def test_repeat_harness_catches_a_shuffled_fold_order():
    x = _rows(4, 2048, seed=4)
    rng = random.Random(0)

    def planted():
        # Tile partials folded in a different order on every call, as an atomic accumulation would.
        sums = [x[:, i:i + TILE].sum(dim=1) for i in range(0, x.shape[1], TILE)]
        rng.shuffle(sums)
        total = sums[0]
        for s in sums[1:]:
            total = total + s
        return total / x.shape[1]

    assert repeat_failures(planted, runs=10)


def test_repeatable():
    x = _rows(7, 1000, seed=1)
    assert_repeatable(lambda: fixed_order_mean(x), runs=10)


def test_gradient_reaches_the_input():
    x = _rows(3, 300, seed=2).requires_grad_(True)
    (fixed_order_mean(x) * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    expected = torch.tensor([1.0, 2.0, 3.0]).unsqueeze(1).expand(3, 300) / 300
    assert_bitwise_equal(x.grad, expected.contiguous())


def test_float64_supported():
    x = _rows(4, 300, dtype=torch.float64)
    out = fixed_order_mean(x)
    assert out.dtype == torch.float64
    assert torch.allclose(out, x.mean(1), rtol=1e-14, atol=0)


def test_tile_is_fixed():
    assert TILE == 256


@settings(max_examples=30, deadline=None)
@given(b=st.integers(1, 6), n=st.integers(1, 600), seed=st.integers(0, 10_000), pos=st.integers(0, 5))
def test_row_alone_equals_row_in_batch(b, n, seed, pos):
    x = _rows(b, n, seed=seed)
    pos = pos % b
    assert_bitwise_equal(fixed_order_mean(x)[pos], fixed_order_mean(x[pos:pos + 1].clone())[0])


@pytest.mark.parametrize("bad, error", [
    (torch.zeros(3, 4, dtype=torch.bfloat16), TypeError),
    (torch.zeros(3, 4, dtype=torch.int64), TypeError),
    (torch.zeros(12), ValueError),
    (torch.zeros(3, 0), ValueError),
    (torch.zeros(2, 3, 4), ValueError),
    ([1.0, 2.0], TypeError),
])
def test_bad_inputs(bad, error):
    before = bad.clone() if isinstance(bad, torch.Tensor) else list(bad)
    with pytest.raises(error):
        fixed_order_mean(bad)
    if isinstance(bad, torch.Tensor):
        assert_bitwise_equal(bad, before)
