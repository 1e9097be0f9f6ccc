"""flowlock.ops._launch: the per-specialization launch cache means what ``kernel[grid]`` means."""

import pytest
import torch
import triton
import triton.language as tl

from flowlock.ops._launch import FastLaunch, PlanTable, fast_launch


@triton.jit
def _affine_kernel(x, y, n, scale, B: tl.constexpr):
    offs = tl.program_id(0) * B + tl.arange(0, B)
    mask = offs < n
    tl.store(y + offs, tl.load(x + offs, mask=mask) * scale + 1.0, mask=mask)


_fast_affine = fast_launch(_affine_kernel)


def _run(kernel, x, scale=2.0, block=64):
    y = torch.full_like(x, float("nan"))
    kernel[(triton.cdiv(x.numel(), block),)](x, y, x.numel(), scale, B=block, num_warps=1)
    return y


def test_fast_launch_rejects_non_kernels():
    with pytest.raises(TypeError, match="triton.jit"):
        fast_launch(lambda x: x)


def test_plan_table_keeps_up_to_its_limit_then_starts_afresh():
    plans = PlanTable(2)
    plans.keep(("a",), 1)
    plans.keep(("a",), 2)
    plans.keep(("b",), 3)
    assert plans == {("a",): 2, ("b",): 3}
    plans.keep(("c",), 4)
    assert plans == {("c",): 4}, "a full table starts afresh"


def test_fast_launch_matches_the_plain_launch_under_the_interpreter():
    x = torch.randn(77)
    assert torch.equal(_run(_fast_affine, x), _run(_affine_kernel, x))


@pytest.mark.gpu
def test_fast_launch_reuses_a_kernel_only_for_the_same_specialization():
    base = torch.randn(4096 + 8, device="cuda")
    wrapped = FastLaunch(_affine_kernel)
    # n = 1, divisible by 16, odd; aligned and misaligned pointers; another constexpr; another scale.
    cases = [(base[:1], 2.0, 64), (base[:4096], 2.0, 64), (base[:4097], 2.0, 64), (base[1:4098], 2.0, 64),
             (base[:4096], 2.0, 128), (base[:4096], -3.0, 64)]
    for _ in range(3):
        for x, scale, block in cases:
            got = _run(wrapped, x, scale, block)
            # The kernel may fuse the multiply-add, so the eager formula is a closeness check only.
            torch.testing.assert_close(got, x * scale + 1.0)
            assert torch.equal(got, _run(_affine_kernel, x, scale, block))
    # 1, 16k and odd n specialize differently; so do misalignment and BLOCK; the scale value does not.
    assert len(wrapped._compiled) == 5
