"""MiniMax-H3's output norm: RMSNorm modulated by a per-timestep shift/scale projection."""

from flowlock.ops.final_adaln.api import final_adaln_out

__all__ = ["final_adaln_out"]
