"""Exact float conversions for Triton kernels, the same bits compiled and interpreted.

Triton 3.6's CPU interpreter converts float32 to bfloat16 by truncation and mishandles bfloat16
subnormals, so ``x.to(tl.bfloat16)`` gives different bits interpreted and compiled. Under the
interpreter these helpers therefore convert through integer bit operations (``*_bits``), which are
exact there: float32 → bfloat16 rounds to nearest, ties to even (as PyTorch does), and NaN stays
NaN. Compiled, they use the hardware conversions, which round the same way: one instruction
instead of about nine integer operations per value, which is most of an elementwise kernel's ALU
time. The two agree on every finite value, infinity and subnormal (a GPU test sweeps all bfloat16
values, random float32 bit patterns, ties and subnormals); a NaN stays a NaN, its payload may differ.
Float16 conversions are exact in both modes already and use plain casts.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


@triton.jit
def to_f32_bits(x):
    """Widen a bf16 / fp16 / fp32 tensor to fp32 (exact), bf16 through its bits."""
    if x.dtype == tl.bfloat16:
        bits = x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def round_f32_bits(x, DTYPE: tl.constexpr):
    """Round fp32 ``x`` to the nearest value of ``DTYPE`` (ties to even), returned as fp32; bf16
    through integer operations on the bits."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16) << 16
        # A NaN's low payload could carry into the exponent and read as infinity: keep it NaN.
        return tl.where(x != x, x, rounded.to(tl.float32, bitcast=True))
    elif DTYPE == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def from_f32_bits(x, DTYPE: tl.constexpr):
    """Narrow fp32 ``x`` to ``DTYPE`` (``x`` already representable), bf16 through its bits."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True) >> 16
        # Quiet a NaN whose payload lived only in the dropped low half.
        bits = tl.where(x != x, bits | 0x40, bits)
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)


@triton.jit
def to_f32(x):
    """Widen a bf16 / fp16 / fp32 tensor to fp32 (exact)."""
    if NATIVE:
        return x.to(tl.float32)
    else:
        return to_f32_bits(x)


@triton.jit
def round_f32(x, DTYPE: tl.constexpr):
    """Round fp32 ``x`` to the nearest value of ``DTYPE`` (ties to even), returned as fp32."""
    if DTYPE == tl.float32:
        return x
    elif NATIVE:
        return x.to(DTYPE).to(tl.float32)
    else:
        return round_f32_bits(x, DTYPE)


@triton.jit
def from_f32(x, DTYPE: tl.constexpr):
    """Narrow fp32 ``x`` to ``DTYPE``; ``x`` must already be representable (see :func:`round_f32`)."""
    if NATIVE:
        return x.to(DTYPE)
    else:
        return from_f32_bits(x, DTYPE)


# Hardware conversions when the kernels are compiled; the bit helpers when @triton.jit made
# interpreted functions (TRITON_INTERPRET=1 when Triton decorated this module).
NATIVE = tl.constexpr(not isinstance(to_f32_bits, InterpretedFunction))
