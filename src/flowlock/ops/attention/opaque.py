"""``attention_reference`` as opaque custom ops for torch.compile
(:mod:`flowlock.ops._opaque`): inductor sees one node per call and cannot rewrite the arithmetic."""

from __future__ import annotations

from flowlock.ops._opaque import opaque_reference
from flowlock.ops.attention.reference import attention_reference

attention_reference_op = opaque_reference(
    "attention_reference", attention_reference, "(Tensor q, Tensor k, Tensor v, float scale)", "Tensor",
    lambda q, k, v, scale: q.new_empty(q.shape))
