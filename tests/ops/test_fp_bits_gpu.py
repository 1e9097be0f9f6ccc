"""The compiled conversions (hardware casts) give the bits of the integer-bit helpers the
interpreter runs, on every bfloat16 value, random float32 bit patterns, ties, subnormals and
infinities; NaN stays NaN."""

import pytest
import torch
import triton
import triton.language as tl

from flowlock.ops._fp_bits import NATIVE, from_f32, from_f32_bits, round_f32, round_f32_bits, to_f32, to_f32_bits

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
BLOCK = 1024


@triton.jit
def _both_kernel(x_ptr, native_ptr, bits_ptr, n, DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(native_ptr + offs, from_f32(round_f32(to_f32(x), DTYPE), DTYPE), mask=mask)
    tl.store(bits_ptr + offs, from_f32_bits(round_f32_bits(to_f32_bits(x), DTYPE), DTYPE), mask=mask)


def _both(x, dtype):
    native, bits = (torch.empty(x.shape, dtype=dtype, device=x.device) for _ in range(2))
    _both_kernel[(triton.cdiv(x.numel(), BLOCK),)](x, native, bits, x.numel(), DTYPE=_TL[dtype], BLOCK=BLOCK)
    return native, bits


def _assert_same(native, bits, what):
    ints = torch.int16 if native.element_size() == 2 else torch.int32
    same = (native.view(ints) == bits.view(ints)) | (torch.isnan(native) & torch.isnan(bits))
    assert bool(same.all()), f"{what}: {int((~same).sum())} values differ"


def test_compiled_helpers_are_native():
    assert bool(NATIVE)


def test_native_conversions_equal_bit_conversions():
    every_bf16 = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).cuda()
    native, bits = _both(every_bf16, torch.float32)
    _assert_same(native, bits, "bf16 -> fp32")
    gen = torch.Generator().manual_seed(0)
    random_f32 = torch.randint(-2**31, 2**31 - 1, (1 << 20,), generator=gen, dtype=torch.int64).to(torch.int32)
    finite_bf16 = every_bf16[torch.isfinite(every_bf16)].float().cpu()
    ties = (finite_bf16.view(torch.int32) + 0x8000).view(torch.float32)
    subnormal = torch.randn(1 << 16, generator=gen) * 1e-39
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 3.3895314e38, -3.3895314e38])
    for name, src in (("random fp32 bits", random_f32.view(torch.float32)), ("ties", ties),
                      ("subnormals", subnormal), ("specials", specials)):
        for dtype in (torch.bfloat16, torch.float16):
            native, bits = _both(src.cuda(), dtype)
            _assert_same(native, bits, f"{name} -> {dtype}")
