"""Row gather / scatter of a packed sequence: exact copies in both directions, no accumulation."""

from flowlock.ops.rows.api import gather_rows, scatter_rows

__all__ = ["gather_rows", "scatter_rows"]
