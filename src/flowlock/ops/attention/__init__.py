"""Full non-causal attention with fixed KV order: rows pure, batch-invariant, repeatable gradients."""

from flowlock.ops.attention.api import attention
from flowlock.ops.attention.reference import attention_golden, attention_reference

__all__ = ["attention", "attention_golden", "attention_reference"]
