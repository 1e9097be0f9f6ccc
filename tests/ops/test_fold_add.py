"""``fold_add`` (flowlock.ops._dot), the fp32 addition of every dQ fold step, interpreted: round to
nearest with subnormal operands and sums flushed to a zero of their sign, as the PTX ``add.rn.ftz.f32``
and the TMA unit's ``.add.f32`` reductions define it. Expected values follow from that definition."""

import numpy as np
import torch
import triton
import triton.language as tl

from flowlock.ops._dot import fold_add

TINY = float(np.finfo(np.float32).tiny)  # 2**-126, the smallest normal fp32


@triton.jit
def _fold_add_kernel(A, B, Out, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(Out + offs, fold_add(tl.load(A + offs), tl.load(B + offs)))


def _fold(a: list[float], b: list[float]) -> torch.Tensor:
    """``fold_add`` elementwise (the lists padded with ones to a power-of-two tile)."""
    n = triton.next_power_of_2(len(a))
    a_t, b_t = (torch.tensor(x + [1.0] * (n - len(x)), dtype=torch.float32) for x in (a, b))
    out = torch.empty_like(a_t)
    _fold_add_kernel[(1,)](a_t, b_t, out, N=n)
    return out[:len(a)]


def _bits(t: torch.Tensor) -> list[int]:
    return t.view(torch.int32).tolist()


def _f32(x: float) -> torch.Tensor:
    return torch.tensor([x], dtype=torch.float32)


def test_normal_operands_add_as_plain_fp32():
    a = [1.0, -3.25, 1e30, 2.0 ** -100, 0.1, TINY * 4]
    b = [2.0 ** -24, 3.25, -1e30, 2.0 ** -101, 0.2, -TINY * 2]
    want = torch.tensor(a, dtype=torch.float32) + torch.tensor(b, dtype=torch.float32)
    assert _bits(_fold(a, b)) == _bits(want)


def test_subnormal_operands_count_as_zero():
    sub = TINY / 4
    got = _fold([1.0, sub, -sub, sub, 0.0], [sub, 1.0, 0.0, -sub, -sub])
    # 1 + flushed sub = 1; sub + 1 = 1; -sub -> -0, -0 + +0 = +0; +0 + -0 = +0; +0 + -0 = +0
    assert _bits(got) == _bits(torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0], dtype=torch.float32))


def test_a_subnormal_sum_is_flushed_with_its_sign():
    a, b = 1.5 * TINY, -1.25 * TINY  # exact sum 0.25 * TINY, a subnormal
    got = _fold([a, -a], [b, -b])
    assert _bits(got) == _bits(torch.tensor([0.0, -0.0], dtype=torch.float32))
    assert (_f32(a) + _f32(b)).item() != 0.0  # a plain fp32 addition keeps it


def test_signed_zeros_add_as_ieee():
    got = _fold([0.0, -0.0, -0.0, 0.0], [-0.0, -0.0, 0.0, 0.0])
    assert _bits(got) == _bits(torch.tensor([0.0, -0.0, 0.0, 0.0], dtype=torch.float32))
