"""``gate_residual_reference`` as opaque custom ops for torch.compile
(:mod:`flowlock.ops._opaque`): inductor sees one node per call and cannot rewrite the arithmetic."""

from __future__ import annotations

from flowlock.ops._opaque import opaque_reference
from flowlock.ops.gate_residual.reference import gate_residual_reference

gate_residual_reference_op = opaque_reference(
    "gate_residual_reference", gate_residual_reference, "(Tensor residual, Tensor gate, Tensor y, Tensor index)",
    "Tensor", lambda residual, gate, y, index: residual.new_empty(residual.shape))
