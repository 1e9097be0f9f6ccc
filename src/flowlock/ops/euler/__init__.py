"""H3's Euler (eta = 0) sampler update, bitwise equal to diffusers."""

from flowlock.ops.euler.api import euler_step

__all__ = ["euler_step"]
