"""``euler_step_reference`` as opaque custom ops for torch.compile
(:mod:`flowlock.ops._opaque`): inductor sees one node per call and cannot rewrite the arithmetic."""

from __future__ import annotations

from flowlock.ops._opaque import opaque_reference
from flowlock.ops.euler.reference import euler_step_reference

euler_step_reference_op = opaque_reference(
    "euler_step_reference", euler_step_reference,
    "(Tensor sample, Tensor velocity, Tensor timestep, Tensor sigma, Tensor sigma_next)", "Tensor",
    lambda sample, velocity, timestep, sigma, sigma_next: sample.new_empty(sample.shape))
