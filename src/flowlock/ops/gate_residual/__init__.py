"""The gated residual update of an AdaLN block: ``residual + gate[index] * y``."""

from flowlock.ops.gate_residual.api import gate_residual

__all__ = ["gate_residual"]
