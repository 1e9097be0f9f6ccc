"""One Triton launch per draw of :mod:`flowlock.rl.noise`'s keyed Gaussian noise, same bits as the torch spec.

The torch spec (``noise._keyed_normal``, :mod:`flowlock.rl.philox`, :mod:`flowlock.rl.ieee_math`) is
about 400 small ops per draw, each a kernel launch on a GPU; this module computes the same function in
one kernel. Bit equality rests on doing exactly what the spec does, operation for operation:

* Philox4x32-10 on uint32 words (``tl.umulhi`` gives the high word of each product, a plain uint32
  ``*`` the low word), counter ``(e // 2, step key, sample id, modality code)``, key ``(seed low 32,
  seed high 32)``.
* The same 52-bit uniforms, then ``log`` and ``cos``/``sin`` of a turn with the spec's constants, term
  counts and evaluation order (the constants are imported from :mod:`flowlock.rl.ieee_math`, so the
  two cannot drift apart). Every float64 step is a correctly rounded ``+ - * /``, an exact ``floor``,
  exact bit surgery or a correctly rounded ``sqrt`` (Triton emits ``div.rn.f64`` and ``sqrt.rn.f64``
  for float64 ``/`` and ``tl.sqrt``; ``tl.math.div_rn`` / ``tl.sqrt_rn`` take float32 only).
* The kernel is launched with ``enable_fp_fusion=False``: the spec rounds every product before the
  next add, and a contracted FMA would not.
* Negation is ``x * -1.0``: Triton's unary minus is ``0 - x``, which maps ``+0.0`` to ``+0.0`` where the
  spec's ``-x`` gives ``-0.0`` (a cosine or sine of a turn at an exact quarter is a signed zero).
* One rounding to float32 at the end; element ``2p`` is ``radius * cos``, ``2p + 1`` is ``radius * sin``
  of pair ``p``.

Every element is a pure function of its key and index, so the block size and warp count change no bit;
they are fixed here all the same, as every flowlock launch config is.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flowlock.ops._launch import fast_launch
from flowlock.ops._triton_utils import cdiv
from flowlock.rl import ieee_math, philox

# Pairs per program and warps: elementwise float64 work, sized by design (not timed).
BLOCK = 256
NUM_WARPS = 4

_M0, _M1 = tl.constexpr(philox._M0), tl.constexpr(philox._M1)
_W0, _W1 = tl.constexpr(philox._W0), tl.constexpr(philox._W1)
_ROUNDS = tl.constexpr(philox.ROUNDS)
_LN2 = tl.constexpr(ieee_math._LN2)
_SQRT2 = tl.constexpr(ieee_math._SQRT2)
_HALF_PI = tl.constexpr(ieee_math._HALF_PI)
_ATANH_TERMS = tl.constexpr(ieee_math._ATANH_TERMS)
_SIN_TERMS = tl.constexpr(ieee_math._SIN_TERMS)
_COS_TERMS = tl.constexpr(ieee_math._COS_TERMS)
_TWO_POW_M52 = tl.constexpr(2.0**-52)
# The spec's Taylor coefficients, evaluated by the spec's own function when the kernel is compiled.
_inv_factorial_signed = triton.constexpr_function(ieee_math._inv_factorial_signed)


@triton.jit
def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Ten Philox rounds on four uint32 counter words (same shape) and two uint32 key words."""
    for _ in tl.static_range(_ROUNDS):
        hi0 = tl.umulhi(c0, _M0)
        lo0 = c0 * _M0
        hi1 = tl.umulhi(c2, _M1)
        lo1 = c2 * _M1
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = k0 + _W0
        k1 = k1 + _W1
    return c0, c1, c2, c3


@triton.jit
def _neg(x):
    """``-x`` with the sign of zero flipped too (Triton's unary minus is ``0 - x``); exact."""
    return x * -1.0


@triton.jit
def log_f64(x):
    """Natural log of positive, normal float64 ``x``: :func:`flowlock.rl.ieee_math.log_f64`'s bits."""
    bits = x.to(tl.int64, bitcast=True)
    exponent = ((bits >> 52) & 0x7FF) - 1023
    mantissa = ((bits & 0x000FFFFFFFFFFFFF) | (1023 << 52)).to(tl.float64, bitcast=True)
    high = mantissa >= _SQRT2
    mantissa = tl.where(high, mantissa * 0.5, mantissa)
    exponent = exponent + high.to(tl.int64)
    s = (mantissa - 1.0) / (mantissa + 1.0)
    s2 = s * s
    poly = tl.full(s.shape, 1.0 / (2 * _ATANH_TERMS - 1), tl.float64)
    for k in tl.static_range(_ATANH_TERMS - 2, -1, -1):
        poly = poly * s2
        poly = poly + 1.0 / (2 * k + 1)
    ln_m = (s * poly) * 2.0
    return exponent.to(tl.float64) * _LN2 + ln_m


@triton.jit
def _sin_poly(x):
    x2 = x * x
    poly = tl.full(x.shape, _inv_factorial_signed(2 * _SIN_TERMS - 1), tl.float64)
    for k in tl.static_range(_SIN_TERMS - 2, -1, -1):
        poly = poly * x2
        poly = poly + _inv_factorial_signed(2 * k + 1)
    return poly * x


@triton.jit
def _cos_poly(x):
    x2 = x * x
    poly = tl.full(x.shape, _inv_factorial_signed(2 * _COS_TERMS - 2), tl.float64)
    for k in tl.static_range(_COS_TERMS - 2, -1, -1):
        poly = poly * x2
        poly = poly + _inv_factorial_signed(2 * k)
    return poly


@triton.jit
def cos_sin_turns(u):
    """``(cos(2 pi u), sin(2 pi u))`` for float64 ``u`` in ``[0, 1)``, multiples of 2^-50:
    :func:`flowlock.rl.ieee_math.cos_sin_turns`'s bits."""
    four_u = u * 4.0
    q = tl.floor(four_u)
    f = four_u - q
    upper = f > 0.5
    x = tl.where(upper, 1.0 - f, f) * _HALF_PI
    s = _sin_poly(x)
    c = _cos_poly(x)
    sin_phi = tl.where(upper, c, s)
    cos_phi = tl.where(upper, s, c)
    q = q.to(tl.int32)
    cos_t = tl.where(q == 0, cos_phi, tl.where(q == 1, _neg(sin_phi), tl.where(q == 2, _neg(cos_phi), sin_phi)))
    sin_t = tl.where(q == 0, sin_phi, tl.where(q == 1, cos_phi, tl.where(q == 2, _neg(sin_phi), _neg(cos_phi))))
    return cos_t, sin_t


# The key scalars are not specialized (no value-1 or divisible-by-16 variants), so a new seed, id or
# step reuses the compiled kernel; only an integer's width (i32, i64, u64 by value) picks a variant.
# The output pointer is not specialized on alignment, so every row of a batch shares one variant.
@fast_launch
@triton.jit(do_not_specialize=["numel", "seed", "sample_id", "step_key", "code"],
            do_not_specialize_on_alignment=["out_ptr"])
def _keyed_normal_kernel(out_ptr, numel, seed, sample_id, step_key, code, BLOCK: tl.constexpr):
    # out_ptr: (numel,) float32; this program writes pairs [pid * BLOCK, pid * BLOCK + BLOCK).
    i_p = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    o_even = i_p * 2
    seed = seed.to(tl.uint64)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = (seed >> 32).to(tl.uint32)
    zero = tl.zeros([BLOCK], dtype=tl.uint32)
    # Pair indices stay below 2^32: the API caps a draw at 2^33 elements.
    w0, w1, w2, w3 = philox4x32_10(i_p.to(tl.uint32), zero + step_key.to(tl.uint32),
                                   zero + sample_id.to(tl.uint32), zero + code.to(tl.uint32), k0, k1)
    # 26 high bits of two words each -> 52-bit integers -> uniforms (k + 1/2) * 2^-52 in (0, 1), exact.
    b_k1 = ((w0 >> 6).to(tl.int64) << 26) | (w1 >> 6).to(tl.int64)
    b_k2 = ((w2 >> 6).to(tl.int64) << 26) | (w3 >> 6).to(tl.int64)
    b_u1 = (b_k1.to(tl.float64) + 0.5) * _TWO_POW_M52
    b_u2 = b_k2.to(tl.float64) * _TWO_POW_M52
    b_radius = tl.sqrt(log_f64(b_u1) * -2.0)
    b_cos, b_sin = cos_sin_turns(b_u2)
    tl.store(out_ptr + o_even, (b_radius * b_cos).to(tl.float32), mask=o_even < numel)
    tl.store(out_ptr + o_even + 1, (b_radius * b_sin).to(tl.float32), mask=o_even + 1 < numel)


def keyed_normal_fwd(out: torch.Tensor, seed: int, sample_id: int, step_key: int, code: int) -> torch.Tensor:
    """Trusted launcher: fill contiguous float32 ``out`` (any shape, numbered row-major) with the draw
    of ``(seed, sample_id, step_key, code)``, one launch, and return it.

    The caller has validated the key (``seed`` in [0, 2^64), the others in [0, 2^32)) and
    ``out.numel() <= 2^33``; ``out`` lives on a CUDA device, or on the CPU under ``TRITON_INTERPRET=1``.
    """
    numel = out.numel()
    _keyed_normal_kernel[(cdiv(cdiv(numel, 2), BLOCK),)](
        out, numel, seed, sample_id, step_key, code, BLOCK=BLOCK, num_warps=NUM_WARPS, enable_fp_fusion=False)
    return out
