"""AdaLN modulation of MiniMax-H3 blocks: the ``(3T, 6H)`` table and its per-row gather."""

from flowlock.ops.adaln.api import adaln_modulation, adaln_table

__all__ = ["adaln_modulation", "adaln_table"]
