"""fold_partials: the shared multi-level tile fold equals its PyTorch spec bitwise, is repeatable, and
its group size (part of the reduction order) is a frozen per-arch constant."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flowlock.config import launch_config
from flowlock.keys import device_arch
from flowlock.ops.segment_sum.fold import fold_group, fold_partials
from flowlock.ops.segment_sum.reference import fold_partials_reference
from flowlock.testing import assert_bitwise_equal, assert_repeatable, bitwise_equal, repeat_failures

GROUP = fold_group("interp")


def _partials(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    # Mixed magnitudes make fp32 addition visibly order-dependent.
    return torch.randn(shape, generator=g) * torch.exp2(torch.randint(-12, 12, shape, generator=g).float())


def _explicit_two_level(p):
    """Level 1: ascending sums of GROUP consecutive tiles; level 2: ascending sum of the group sums."""
    sums = []
    for first in range(0, p.shape[0], GROUP):
        acc = p[first].clone()
        for t in range(first + 1, min(first + GROUP, p.shape[0])):
            acc = acc + p[t]
        sums.append(acc)
    total = sums[0].clone()
    for s in sums[1:]:
        total = total + s
    return total


def test_interpreter_group_is_small_and_sizes_are_frozen_constants():
    assert GROUP == 4
    assert fold_group("sm90") == 32
    assert launch_config("qk_norm_rope_bwd", torch.bfloat16, "sm90")["TILE_ROWS"] == 64


@pytest.mark.parametrize("tiles", [1, GROUP, GROUP + 1, GROUP * GROUP])
@pytest.mark.parametrize("tail", [(7,), (3, 90), (300,)])
def test_two_level_tile_counts_match_explicit_pytorch_fold(tiles, tail):
    p = _partials((tiles, *tail), seed=tiles)
    out = fold_partials(p)
    assert out.shape == tail and out.dtype == torch.float32
    assert_bitwise_equal(out, _explicit_two_level(p), f"{tiles} tiles")


@pytest.mark.parametrize("tiles", [GROUP * GROUP + 1, GROUP ** 3 + 3])
def test_several_levels_match_reference(tiles):
    p = _partials((tiles, 2, 33), seed=tiles)
    assert_bitwise_equal(fold_partials(p), fold_partials_reference(p, GROUP), f"{tiles} tiles")


def test_grouped_order_is_not_the_plain_ascending_fold():
    """Sanity: the grouped order really differs from one running sum (2^24 + 1 rounds back to 2^24)."""
    p = torch.tensor([[2.0 ** 24]] + [[0.0]] * (GROUP - 1) + [[1.0], [1.0]])
    plain = p[0].clone()
    for t in range(1, p.shape[0]):
        plain = plain + p[t]
    grouped = fold_partials(p)
    assert_bitwise_equal(grouped, _explicit_two_level(p))
    assert not bitwise_equal(grouped, plain)


@settings(max_examples=10, deadline=None)
@given(tiles=st.integers(1, 40), width=st.integers(1, 300), seed=st.integers(0, 2 ** 16))
def test_matches_reference_hypothesis(tiles, width, seed):
    p = _partials((tiles, width), seed)
    assert_bitwise_equal(fold_partials(p), fold_partials_reference(p, GROUP))


def test_repeatable_and_harness_catches_planted_shuffle():
    p = _partials((GROUP ** 2 + 2, 5, 17), seed=1)
    assert_repeatable(lambda: fold_partials(p), runs=5)
    gen = torch.Generator().manual_seed(0)
    assert repeat_failures(lambda: fold_partials_reference(p[torch.randperm(p.shape[0], generator=gen)], GROUP),
                           runs=10)


def test_input_unchanged():
    p = _partials((GROUP + 3, 9))
    before = p.clone()
    fold_partials(p)
    assert_bitwise_equal(p, before)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(3584, 128), (28672, 128), (257, 9, 3072)])
def test_cuda_matches_reference_at_h3_tile_counts(shape):
    """qk_norm_rope's dweight partials at S=16384 (TILE_ROWS 256 and the old 32) and a wide segment sum."""
    p = _partials(shape, seed=2)
    out = fold_partials(p.cuda())
    assert_bitwise_equal(out.cpu(), fold_partials_reference(p, fold_group(device_arch())))
    assert_repeatable(lambda: fold_partials(p.cuda()), runs=5)
