"""``segment_sum_reference`` as opaque custom ops for torch.compile
(:mod:`flowlock.ops._opaque`): inductor sees one node per call and cannot rewrite the arithmetic."""

from __future__ import annotations

import torch

from flowlock.ops._opaque import opaque_reference
from flowlock.ops.segment_sum.reference import segment_sum_reference

segment_sum_reference_op = opaque_reference(
    "segment_sum_reference", segment_sum_reference, "(Tensor values, Tensor index, SymInt num_segments)", "Tensor",
    lambda values, index, num_segments: values.new_empty((num_segments, values.shape[1]), dtype=torch.float32))
