"""Philox4x32-10 (Salmon et al., SC'11) in int64 torch arithmetic.

Each 32-bit word lives in an int64 tensor and is masked back to 32 bits after every operation;
the 32x32 -> 64-bit products are split into 16-bit halves so no intermediate exceeds 2^49. Integer
arithmetic is exact on every device, so the output bits are the same on CPU and GPU.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_M0, _M1 = 0xD2511F53, 0xCD9E8D57
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
ROUNDS = 10


def _mulhilo(a: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32-bit words of ``a * b`` for 32-bit ``a`` (tensor) and ``b`` (constant)."""
    b_lo, b_hi = b & 0xFFFF, b >> 16
    t_lo = a * b_lo
    t_hi = a * b_hi
    low_part = t_lo + ((t_hi & 0xFFFF) << 16)
    lo = low_part & _MASK32
    hi = ((low_part >> 32) + (t_hi >> 16)) & _MASK32
    return hi, lo


def philox4x32(counter: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
               key: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ten Philox rounds on four int64 tensors of 32-bit words (broadcastable) with a 64-bit key."""
    c0, c1, c2, c3 = (torch.as_tensor(c).to(torch.int64) & _MASK32 for c in counter)
    k0, k1 = key[0] & _MASK32, key[1] & _MASK32
    for _ in range(ROUNDS):
        hi0, lo0 = _mulhilo(c0, _M0)
        hi1, lo1 = _mulhilo(c2, _M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
    return c0, c1, c2, c3
