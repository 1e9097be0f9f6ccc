"""``adaln_table_reference`` and ``adaln_modulation_reference`` as opaque custom ops for torch.compile
(:mod:`flowlock.ops._opaque`): inductor sees one node per call and cannot rewrite the arithmetic."""

from __future__ import annotations

from flowlock.ops._opaque import opaque_reference
from flowlock.ops.adaln.reference import adaln_modulation_reference, adaln_table_reference

adaln_table_reference_op = opaque_reference(
    "adaln_table_reference", adaln_table_reference, "(Tensor temb, Tensor weight, Tensor bias)", "Tensor",
    lambda temb, weight, bias: temb.new_empty((3 * temb.shape[0], weight.shape[0] // 3)))


def _modulation_fake(temb, weight, bias, timestep_indices, token_tags):
    shape = (timestep_indices.shape[0], weight.shape[0] // 18)
    return tuple(weight.new_empty(shape) for _ in range(6))


adaln_modulation_reference_op = opaque_reference(
    "adaln_modulation_reference", adaln_modulation_reference,
    "(Tensor temb, Tensor weight, Tensor bias, Tensor timestep_indices, Tensor token_tags)",
    "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)", _modulation_fake)
