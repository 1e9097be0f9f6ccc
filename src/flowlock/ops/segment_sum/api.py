"""Public segment_sum: validation, then the chosen backend."""

from __future__ import annotations

import torch

from flowlock.dispatch import backend_for
from flowlock.ops._triton_utils import traced
from flowlock.ops._validate import FLOAT_DTYPES, check_index, check_tensor
from flowlock.ops.segment_sum.opaque import segment_sum_reference_op
from flowlock.ops.segment_sum.reference import segment_sum_reference
from flowlock.ops.segment_sum.triton import segment_sum_fwd


def segment_sum(values: torch.Tensor, index: torch.Tensor, num_segments: int, *,
                check_indices: bool = True) -> torch.Tensor:
    """Sum the rows of ``values`` by segment: ``out[r] = Σ_{s: index[s] = r} values[s]``.

    Args:
        values: ``(S, N)`` float32, bfloat16 or float16, unit column stride.
        index: ``(S,)`` int32 or int64 on ``values``' device, entries in ``[0, num_segments)``
            (checked, never clamped, unless ``check_indices=False``).
        num_segments: ``R >= 1``.

    Returns:
        ``(R, N)`` float32; segments without rows are zero.

    Guarantees: on Triton, rows are summed in fp32 over fixed 64-row tiles (a fixed tree per tile)
    and the tile partials are folded in fixed ascending groups, level by level (``fold_partials``), so
    the bits depend only on the inputs and are repeatable; no atomics, no sorting. The reference sums
    in fp64 and rounds once. The Triton path has no autograd (it is a backward building block):
    ``values`` requiring grad is refused.
    """
    check_tensor("values", values, dtypes=FLOAT_DTYPES, ndim=2)
    if isinstance(num_segments, bool) or not isinstance(num_segments, int):
        raise TypeError(f"num_segments must be an int, got {type(num_segments).__name__}")
    if num_segments < 1:
        raise ValueError(f"num_segments must be >= 1, got {num_segments}")
    if values.shape[1] > 1 and values.stride(1) != 1:
        raise ValueError(f"values must have unit column stride, got strides {values.stride()}")
    check_index("index", index, length=values.shape[0], upper=num_segments, device=values.device,
                check_range=check_indices)
    backend = backend_for("segment_sum", values, index)
    if backend == "reference":
        return (segment_sum_reference_op if traced() else segment_sum_reference)(values, index, num_segments)
    if values.requires_grad and torch.is_grad_enabled():
        raise ValueError("values requires grad, but segment_sum's Triton path has no backward")
    return segment_sum_fwd(values, index, num_segments)
