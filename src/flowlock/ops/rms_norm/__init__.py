"""RMSNorm and RMSNorm with per-row AdaLN modulation."""

from flowlock.ops.rms_norm.api import rms_norm, rms_norm_modulate

__all__ = ["rms_norm", "rms_norm_modulate"]
