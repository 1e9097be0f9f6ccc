"""``gather_rows_reference`` and ``scatter_rows_reference`` as opaque custom ops for torch.compile
(:mod:`flowlock.ops._opaque`): inductor sees one node per call and cannot rewrite the arithmetic."""

from __future__ import annotations

from flowlock.ops._opaque import opaque_reference
from flowlock.ops.rows.reference import gather_rows_reference, scatter_rows_reference

gather_rows_reference_op = opaque_reference(
    "gather_rows_reference", gather_rows_reference, "(Tensor x, Tensor index)", "Tensor",
    lambda x, index: x.new_empty((x.shape[0], index.shape[0], x.shape[2])))

scatter_rows_reference_op = opaque_reference(
    "scatter_rows_reference", scatter_rows_reference, "(Tensor[] parts, Tensor[] indices, SymInt seq_len)", "Tensor",
    lambda parts, indices, seq_len: parts[0].new_empty((parts[0].shape[0], seq_len, parts[0].shape[2])))
