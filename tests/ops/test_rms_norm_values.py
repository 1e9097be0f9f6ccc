"""Adversarial value builders shared by the norms tests (rms_norm, rms_norm_modulate, gate_residual),
and the exact float conversions (``flowlock.ops._fp_bits``) their kernels rely on."""

import torch
import triton
import triton.language as tl

from flowlock.ops._fp_bits import from_f32, round_f32, to_f32

_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

MODES = ("normal", "bits", "ties", "tiny", "huge")


def adversarial(shape, dtype, mode, gen):
    """Finite values of ``dtype`` (returned in ``dtype``): ``normal`` draws, random bit patterns,
    half-way cases for a following add/multiply (``ties``), subnormals (``tiny``), near-overflow (``huge``)."""
    if mode == "normal":
        return torch.randn(shape, generator=gen).to(dtype)
    if mode == "bits":
        if dtype == torch.float32:
            bits = torch.randint(-2**31, 2**31 - 1, shape, generator=gen, dtype=torch.int64).to(torch.int32)
        else:
            bits = torch.randint(-2**15, 2**15 - 1, shape, generator=gen, dtype=torch.int32).to(torch.int16)
        v = bits.view(dtype)
        return torch.where(torch.isfinite(v), v, torch.zeros((), dtype=dtype))
    finfo = torch.finfo(dtype)
    if mode == "ties":
        # Odd multiples of half the resolution at 1: 1 + v and products with such factors land on ties.
        k = torch.randint(-64, 64, shape, generator=gen) * 2 + 1
        return (k.double() * finfo.eps / 2).to(dtype)
    if mode == "tiny":
        return (torch.randn(shape, generator=gen, dtype=torch.float64) * finfo.tiny * 2).to(dtype)
    return (torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1).mul(finfo.max).to(dtype)


def test_adversarial_values_are_finite_and_typed():
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for mode in MODES:
            v = adversarial((64,), dtype, mode, gen)
            assert v.dtype == dtype and bool(torch.isfinite(v).all()), (dtype, mode)


@triton.jit
def _round_trip_kernel(x_ptr, y_ptr, n, DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = to_f32(tl.load(x_ptr + offs, mask=mask))
    tl.store(y_ptr + offs, from_f32(round_f32(x, DTYPE), DTYPE), mask=mask)


def _convert(x, dtype):
    y = torch.empty(x.shape, dtype=dtype)
    _round_trip_kernel[(triton.cdiv(x.numel(), 4096),)](x, y, x.numel(), DTYPE=_TL[dtype], BLOCK=4096)
    return y


def _same(a, b):
    return bool(((a.view(torch.int16 if a.element_size() == 2 else torch.int32)
                  == b.view(torch.int16 if b.element_size() == 2 else torch.int32))
                 | (torch.isnan(a) & torch.isnan(b))).all())


def test_fp_bits_conversions_match_torch():
    """The interpreter truncates fp32 -> bf16 casts; flowlock's bit helpers round like torch (RNE)."""
    every_bf16 = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    assert _same(_convert(every_bf16, torch.float32), every_bf16.float())
    gen = torch.Generator().manual_seed(0)
    random_f32 = torch.randint(-2**31, 2**31 - 1, (20000,), generator=gen, dtype=torch.int64).to(torch.int32)
    finite_bf16 = every_bf16[torch.isfinite(every_bf16)].float()
    ties = (finite_bf16.view(torch.int32) + 0x8000).view(torch.float32)
    subnormal = torch.randn(2000, generator=gen) * 1e-39
    for src in (random_f32.view(torch.float32), ties, subnormal):
        for dtype in (torch.bfloat16, torch.float16):
            assert _same(_convert(src, dtype), src.to(dtype)), dtype
