"""Elementwise transcendental functions whose CPU bits do not depend on where a value sits.

ATen's CPU elementwise loops run a vector routine over the body of a tensor and a scalar routine
over its tail (the last elements short of two vector widths), and for ``exp2``, ``sigmoid``, SiLU
and ``rsqrt`` the two disagree in the last float32 bit (measured: 3–50% of values, on AVX2 and
AVX-512 hosts alike). Which values land in the tail depends on the tensor's length and on the
host's vector width, so a float32 evaluation makes a row's bits depend on its batch, its packing
and the CPU. :func:`in_float64` evaluates in float64, where the two routines differ far below half
a float32 unit, and rounds once: the reference backends' usual in-practice guarantee (a value
within 2^-29 of a float32 rounding boundary could still differ).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def in_float64(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` evaluated in float64 and rounded once to ``x.dtype``; differentiable through ``fn``."""
    if x.dtype == torch.float64:
        return fn(x)
    return fn(x.double()).to(x.dtype)
