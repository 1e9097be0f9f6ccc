"""``rms_norm_reference`` and ``rms_norm_modulate_reference`` as opaque custom ops for torch.compile
(:mod:`flowlock.ops._opaque`): inductor sees one node per call and cannot rewrite the arithmetic."""

from __future__ import annotations

from flowlock.ops._opaque import opaque_reference
from flowlock.ops.rms_norm.reference import rms_norm_modulate_reference, rms_norm_reference

rms_norm_reference_op = opaque_reference(
    "rms_norm_reference", rms_norm_reference, "(Tensor x, Tensor weight, float eps)", "Tensor",
    lambda x, weight, eps: x.new_empty(x.shape))

rms_norm_modulate_reference_op = opaque_reference(
    "rms_norm_modulate_reference", rms_norm_modulate_reference,
    "(Tensor x, Tensor weight, Tensor shift, Tensor scale, Tensor index, float eps)", "Tensor",
    lambda x, weight, shift, scale, index, eps: x.new_empty(x.shape))
