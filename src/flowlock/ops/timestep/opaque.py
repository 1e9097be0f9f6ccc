"""``timestep_sinusoid_reference`` and ``timestep_mlp_reference`` as opaque custom ops for torch.compile
(:mod:`flowlock.ops._opaque`): inductor sees one node per call and cannot rewrite the arithmetic."""

from __future__ import annotations

from flowlock.ops._opaque import opaque_reference
from flowlock.ops.timestep.reference import CHANNELS, timestep_mlp_reference, timestep_sinusoid_reference

timestep_sinusoid_reference_op = opaque_reference(
    "timestep_sinusoid_reference", timestep_sinusoid_reference, f"(Tensor t, SymInt channels={CHANNELS})", "Tensor",
    lambda t, channels=CHANNELS: t.new_empty((t.shape[0], channels)))

timestep_mlp_reference_op = opaque_reference(
    "timestep_mlp_reference", timestep_mlp_reference, "(Tensor x, Tensor w1, Tensor b1, Tensor w2, Tensor b2)",
    "Tensor", lambda x, w1, b1, w2, b2: x.new_empty((x.shape[0], w2.shape[0])))
