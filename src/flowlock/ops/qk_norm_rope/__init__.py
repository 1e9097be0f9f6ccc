"""H3's per-head QK RMSNorm + rotate-half RoPE, fused, with eager BF16 rounding."""

from flowlock.ops.qk_norm_rope.api import qk_norm_rope

__all__ = ["qk_norm_rope"]
