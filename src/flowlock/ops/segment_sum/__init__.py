"""Deterministic segmented row sums (the building block of flowlock's table-gradient reductions)."""

from flowlock.ops.segment_sum.api import segment_sum

__all__ = ["segment_sum"]
