"""``qk_norm_rope_reference`` as opaque custom ops for torch.compile
(:mod:`flowlock.ops._opaque`): inductor sees one node per call and cannot rewrite the arithmetic."""

from __future__ import annotations

from flowlock.ops._opaque import opaque_reference
from flowlock.ops.qk_norm_rope.reference import qk_norm_rope_reference

qk_norm_rope_reference_op = opaque_reference(
    "qk_norm_rope_reference", qk_norm_rope_reference,
    "(Tensor x, Tensor weight, Tensor cos, Tensor sin, float eps)", "Tensor",
    lambda x, weight, cos, sin, eps: x.new_empty(x.shape))
