"""diffusers' SwiGLU activation (value first), forward bitwise equal to eager BF16."""

from flowlock.ops.swiglu.api import swiglu

__all__ = ["swiglu"]
