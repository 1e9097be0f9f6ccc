"""``linear_reference`` as one opaque custom op for torch.compile (see :mod:`flowlock.ops._opaque`)."""

from __future__ import annotations

from flowlock.ops._opaque import opaque_reference
from flowlock.ops.linear.reference import linear_reference

linear_reference_op = opaque_reference(
    "linear_reference", linear_reference, "(Tensor x, Tensor weight, Tensor? bias, ScalarType out_dtype)", "Tensor",
    lambda x, weight, bias, out_dtype: x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=out_dtype))
