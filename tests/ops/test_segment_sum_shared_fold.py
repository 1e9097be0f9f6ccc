"""segment_sum's launch-saving forms: one partials launch for a pair of reductions over the same tiles,
and one fold over partial arrays placed side by side; each is bitwise equal to its separate launches."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flowlock.ops.segment_sum.fold import fold_partials
from flowlock.ops.segment_sum.triton import num_tiles, segment_sum_partials, write_segment_partials
from flowlock.testing import assert_bitwise_equal

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _inputs(m, n, r, dtype, seed, device):
    g = torch.Generator().manual_seed(seed)
    values = (torch.randn(m, n, generator=g) * 4).to(dtype).to(device)
    other = torch.randn(m, n, generator=g).to(dtype).to(device)
    period = max(m // 2, 1) if m % 2 == 0 else m
    index = torch.randint(0, r, (period,), generator=g).to(device)
    return values, other, index, period


def _pair_equals_two_launches(m, n, r, dtype, seed, device):
    values, other, index, period = _inputs(m, n, r, dtype, seed, device)
    plain = segment_sum_partials(values, index, r, period=period)
    product = segment_sum_partials(values, index, r, other=other, period=period)
    offset = 5
    buf = torch.full((num_tiles(values), offset + 2 * r * n), 7.0, device=device)
    write_segment_partials(buf[:, offset:], values, index, r, other=other, period=period, pair=True)
    tiles = plain.shape[0]
    assert_bitwise_equal(buf[:, offset:offset + r * n], plain.reshape(tiles, -1))
    assert_bitwise_equal(buf[:, offset + r * n:], product.reshape(tiles, -1))
    assert torch.equal(buf[:, :offset], torch.full_like(buf[:, :offset], 7.0)), "columns before the slice written"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m,n,r", [(1, 24, 3), (7, 40, 9), (130, 33, 2)])
def test_pair_partials_equal_two_separate_launches(m, n, r, device):
    _pair_equals_two_launches(m, n, r, torch.bfloat16, 0, device)


@settings(max_examples=15, deadline=None)
@given(m=st.integers(1, 140), n=st.sampled_from([1, 7, 40]), r=st.integers(1, 4),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), seed=st.integers(0, 2**16))
def test_pair_partials_equal_two_separate_launches_hypothesis(m, n, r, dtype, seed):
    _pair_equals_two_launches(m, n, r, dtype, seed, "cpu")


@settings(max_examples=15, deadline=None)
@given(tiles=st.integers(1, 40), widths=st.lists(st.integers(1, 50), min_size=2, max_size=3),
       seed=st.integers(0, 2**16))
def test_one_fold_of_side_by_side_partials_equals_separate_folds(tiles, widths, seed):
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randn(tiles, w, generator=g) * 10 for w in widths]
    together = fold_partials(torch.cat(parts, dim=1))
    assert_bitwise_equal(together, torch.cat([fold_partials(p) for p in parts]))


@pytest.mark.gpu
def test_one_fold_of_side_by_side_partials_equals_separate_folds_cuda():
    g = torch.Generator().manual_seed(0)
    parts = [(torch.randn(65, w, generator=g) * 10).cuda() for w in (5376, 6 * 5376)]
    together = fold_partials(torch.cat(parts, dim=1))
    assert_bitwise_equal(together, torch.cat([fold_partials(p) for p in parts]))
