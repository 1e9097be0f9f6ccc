"""``linear``: batch-invariant GEMM with fixed reduction order (bf16 or true fp32), fwd, dX, dW."""

from flowlock.ops.linear.api import linear, linear_weight_grad
from flowlock.ops.linear.reference import linear_golden, linear_reference

__all__ = ["linear", "linear_golden", "linear_reference", "linear_weight_grad"]
