"""AdaLN modulation of MiniMax-H3 blocks: the ``(3T, 6H)`` table and its per-row gather."""

from flowlock.ops.adaln.api import adaln_modulation, adaln_table, adaln_table_kept

__all__ = ["adaln_modulation", "adaln_table", "adaln_table_kept"]
