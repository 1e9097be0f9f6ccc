"""segment_sum: accuracy vs fp64, the tile/fold layout contract, repeatability, bad inputs."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flowlock
from flowlock.ops.segment_sum import segment_sum
from flowlock.ops.segment_sum.fold import fold_group
from flowlock.ops.segment_sum.reference import fold_partials_reference, segment_sum_golden
from flowlock.ops.segment_sum.triton import (
    segment_sum_fold,
    segment_sum_fwd,
    segment_sum_partials,
    tile_rows,
)
from flowlock.testing import (
    assert_bitwise_equal,
    assert_raise_before_launch,
    assert_repeatable,
    assert_within_budget,
    repeat_failures,
)


def _inputs(s, n, r, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    values = (torch.randn(s, n, generator=g) * 4).to(dtype)
    index = torch.randint(0, r, (s,), generator=g)
    return values, index


def _triton(values, index, r):
    with flowlock.use_backend("triton"):
        return segment_sum(values, index, r)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("s,n,r", [(1, 24, 3), (7, 40, 9), (70, 136, 3), (200, 24, 9)])
def test_matches_fp64_golden_within_budget(s, n, r, dtype):
    values, index = _inputs(s, n, r, dtype)
    out = _triton(values, index, r)
    golden = segment_sum_golden(values, index, r)
    baseline = torch.zeros(r, n).index_add_(0, index, values.float())
    assert out.dtype == torch.float32 and out.shape == (r, n)
    assert_within_budget(out, golden, baseline=baseline, what="segment_sum")


def test_reference_is_golden_rounded_once_and_differentiable():
    values, index = _inputs(33, 40, 9, torch.float32)
    values.requires_grad_(True)
    out = segment_sum(values, index, 9)
    assert_bitwise_equal(out, segment_sum_golden(values, index, 9).float())
    out.sum().backward()
    assert_bitwise_equal(values.grad, torch.ones_like(values))


def test_empty_segments_are_zero():
    values, _ = _inputs(7, 24, 3, torch.float32)
    out = _triton(values, torch.zeros(7, dtype=torch.int32), 3)
    assert torch.equal(out[1:], torch.zeros(2, 24))


def _python_fold(partials):
    return fold_partials_reference(partials, fold_group("interp"))


@settings(max_examples=12, deadline=None)
@given(s=st.integers(1, 400), n=st.integers(1, 40), r=st.integers(1, 5), seed=st.integers(0, 2**16),
       bf16=st.booleans())
def test_layout_contract_tiles_and_grouped_fold(s, n, r, seed, bf16):
    """Tile t's partial equals the sum of its rows run alone; the fold is ``fold_partials``' grouped order."""
    values, index = _inputs(s, n, r, torch.bfloat16 if bf16 else torch.float32, seed)
    partials = segment_sum_partials(values, index, r)
    rows = tile_rows(values.dtype, "interp")
    assert rows == 64 and partials.shape == ((s + rows - 1) // rows, r, n)
    for t in range(partials.shape[0]):
        alone = segment_sum_partials(values[t * rows:(t + 1) * rows], index[t * rows:(t + 1) * rows], r)
        assert_bitwise_equal(partials[t], alone[0], f"tile {t}")
    assert_bitwise_equal(segment_sum_fold(partials), _python_fold(partials), "fold")
    assert_bitwise_equal(_triton(values, index, r), _python_fold(partials), "segment_sum")


@settings(max_examples=8, deadline=None)
@given(b=st.integers(1, 3), s=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_period_and_product_options(b, s, seed):
    """``period`` = a (S,) index shared by B batches; ``other`` = fp32 products (exact for bf16)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(b * s, 24, generator=g).to(torch.bfloat16)
    c = torch.randn(b * s, 24, generator=g).to(torch.bfloat16)
    index = torch.randint(0, 3, (s,), generator=g, dtype=torch.int32)
    expanded = index.repeat(b)
    want = segment_sum_fwd(a.float() * c.float(), expanded, 3)
    assert_bitwise_equal(segment_sum_fwd(a, index, 3, other=c, period=s), want)


def test_repeatable_over_runs():
    values, index = _inputs(200, 40, 9, torch.bfloat16)
    assert_repeatable(lambda: _triton(values, index, 9), runs=20)


def test_repeatability_harness_catches_shuffled_fold():
    """The planted implementation folds the tile partials in a random order each call."""
    values, index = _inputs(640, 24, 3, torch.float32, seed=3)
    partials = segment_sum_partials(values, index, 3)
    gen = torch.Generator().manual_seed(0)

    def shuffled():
        order = torch.randperm(partials.shape[0], generator=gen)
        return _python_fold(partials[order])

    assert repeat_failures(shuffled, runs=20)


def _bad_calls():
    values, index = _inputs(7, 24, 3, torch.float32)
    return [
        (TypeError, "values", lambda: segment_sum(values.to(torch.int32), index, 3)),
        (ValueError, "values", lambda: segment_sum(values[0], index, 3)),
        (ValueError, "values", lambda: segment_sum(torch.randn(7, 48)[:, ::2], index, 3)),
        (TypeError, "index", lambda: segment_sum(values, index.float(), 3)),
        (ValueError, "index", lambda: segment_sum(values, index[:6], 3)),
        (ValueError, "index", lambda: segment_sum(values, torch.full((7,), 3), 3)),
        (ValueError, "index", lambda: segment_sum(values, torch.full((7,), -1), 3)),
        (ValueError, "index", lambda: segment_sum(values, index.to("meta"), 3)),
        (ValueError, "num_segments", lambda: segment_sum(values, index, 0)),
        (TypeError, "num_segments", lambda: segment_sum(values, index, True)),
        (ValueError, "values", lambda: segment_sum(values.clone().requires_grad_(True), index, 3)),
    ], (values, index)


def test_bad_inputs_raise_before_launch_and_leave_inputs_unchanged():
    calls, inputs = _bad_calls()
    with flowlock.use_backend("triton"):
        assert_raise_before_launch(calls, inputs)
