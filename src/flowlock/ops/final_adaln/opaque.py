"""``final_adaln_out_reference`` as opaque custom ops for torch.compile
(:mod:`flowlock.ops._opaque`): inductor sees one node per call and cannot rewrite the arithmetic."""

from __future__ import annotations

from flowlock.ops._opaque import opaque_reference
from flowlock.ops.final_adaln.reference import final_adaln_out_reference

final_adaln_out_reference_op = opaque_reference(
    "final_adaln_out_reference", final_adaln_out_reference,
    "(Tensor x, Tensor temb, Tensor norm_weight, Tensor weight, Tensor bias, Tensor timestep_indices, float eps)",
    "Tensor", lambda x, temb, norm_weight, weight, bias, timestep_indices, eps: x.new_empty(x.shape))
