"""``swiglu_reference`` as opaque custom ops for torch.compile
(:mod:`flowlock.ops._opaque`): inductor sees one node per call and cannot rewrite the arithmetic."""

from __future__ import annotations

from flowlock.ops._opaque import opaque_reference
from flowlock.ops.swiglu.reference import swiglu_reference

swiglu_reference_op = opaque_reference(
    "swiglu_reference", swiglu_reference, "(Tensor h)", "Tensor",
    lambda h: h.new_empty((*h.shape[:-1], h.shape[-1] // 2)))
