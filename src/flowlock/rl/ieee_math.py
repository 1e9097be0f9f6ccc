"""float64 ``log`` and ``cos``/``sin`` built only from correctly rounded IEEE operations.

``torch.log`` / ``torch.cos`` are not correctly rounded and their CPU and CUDA implementations
give different last bits. These versions use only ``+ - * /`` (each a separate torch op, so no
FMA contraction), exact bit manipulation and exact power-of-two scaling, so any IEEE-754 device
produces the same float64 bits. Accuracy is a few float64 ulps, far below the float32 rounding the
callers apply afterwards. Do not run them under ``torch.compile``: fusion could contract to FMA.
"""

from __future__ import annotations

import torch

_LN2 = 0.6931471805599453
_SQRT2 = 1.4142135623730951
_HALF_PI = 1.5707963267948966
# atanh series: ln m = 2 s (1 + s^2/3 + s^4/5 + ...), |s| <= 0.1716 after range reduction.
_ATANH_TERMS = 13
# Taylor terms for |x| <= pi/4; the first omitted term is below 1e-19.
_SIN_TERMS = 11
_COS_TERMS = 11


def log_f64(x: torch.Tensor) -> torch.Tensor:
    """Natural log of positive, normal float64 values (callers guarantee the domain)."""
    bits = x.view(torch.int64)
    exponent = ((bits >> 52) & 0x7FF) - 1023
    # Mantissa in [1, 2): replace the exponent field by the bias (exact bit surgery).
    mantissa = ((bits & 0x000FFFFFFFFFFFFF) | (1023 << 52)).view(torch.float64)
    # Centre on 1 so |s| stays small: m in [sqrt(2)/2, sqrt(2)). Halving is exact.
    high = mantissa >= _SQRT2
    mantissa = torch.where(high, mantissa * 0.5, mantissa)
    exponent = exponent + high.to(torch.int64)
    s = (mantissa - 1.0) / (mantissa + 1.0)
    s2 = s * s
    poly = torch.full_like(s, 1.0 / (2 * _ATANH_TERMS - 1))
    for k in range(_ATANH_TERMS - 2, -1, -1):
        poly = poly * s2
        poly = poly + 1.0 / (2 * k + 1)
    ln_m = (s * poly) * 2.0
    return exponent.to(torch.float64) * _LN2 + ln_m


def _sin_poly(x: torch.Tensor) -> torch.Tensor:
    x2 = x * x
    poly = torch.full_like(x, _inv_factorial_signed(2 * _SIN_TERMS - 1))
    for k in range(_SIN_TERMS - 2, -1, -1):
        poly = poly * x2
        poly = poly + _inv_factorial_signed(2 * k + 1)
    return poly * x


def _cos_poly(x: torch.Tensor) -> torch.Tensor:
    x2 = x * x
    poly = torch.full_like(x, _inv_factorial_signed(2 * _COS_TERMS - 2))
    for k in range(_COS_TERMS - 2, -1, -1):
        poly = poly * x2
        poly = poly + _inv_factorial_signed(2 * k)
    return poly


def _inv_factorial_signed(n: int) -> float:
    """``(-1)^(n//2) / n!`` as a correctly rounded double (Python integer arithmetic)."""
    fact = 1
    for i in range(2, n + 1):
        fact *= i
    return (-1.0 if (n // 2) % 2 else 1.0) / fact


def cos_sin_turns(u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos(2*pi*u)``, ``sin(2*pi*u)`` for float64 ``u`` in ``[0, 1)`` that are multiples of 2^-50.

    The quadrant split ``4u = q + f`` and the reflection ``1 - f`` are exact for such ``u``, so only
    the final ``f * pi/2`` rounds before the polynomials.
    """
    four_u = u * 4.0
    q = torch.floor(four_u)
    f = four_u - q
    upper = f > 0.5
    x = torch.where(upper, 1.0 - f, f) * _HALF_PI
    s, c = _sin_poly(x), _cos_poly(x)
    # Angle within the quadrant: phi = f*pi/2; in the upper half sin(phi) = cos(x), cos(phi) = sin(x).
    sin_phi = torch.where(upper, c, s)
    cos_phi = torch.where(upper, s, c)
    q = q.to(torch.int64)
    cos_t = torch.where(q == 0, cos_phi, torch.where(q == 1, -sin_phi, torch.where(q == 2, -cos_phi, sin_phi)))
    sin_t = torch.where(q == 0, sin_phi, torch.where(q == 1, cos_phi, torch.where(q == 2, -sin_phi, -cos_phi)))
    return cos_t, sin_t
