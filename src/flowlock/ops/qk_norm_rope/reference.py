"""PyTorch spec and FP64 golden of H3's per-head QK RMSNorm followed by rotate-half RoPE.

The spec is diffusers' composition: ``attn.norm_q`` (``nn.RMSNorm(D)`` on BF16 input, which in torch
computes ``x·rsqrt(mean(x²) + eps)·w`` in float32 and rounds once to BF16) then ``_apply_rotary_emb``
(cos/sin cast to BF16; ``x·cos`` and ``rotate_half(x)·sin`` each rounded to BF16, then their BF16 sum;
channels past ``R`` pass through).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flowlock.ops._rounding import st_round


def _rope(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rnd) -> torch.Tensor:
    r = cos.shape[-1]
    rot, rest = y[..., :r], y[..., r:]
    cos = rnd(cos.to(y.dtype))[None, :, None, :]
    sin = rnd(sin.to(y.dtype))[None, :, None, :]
    x1, x2 = rot.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return torch.cat((rnd(rnd(rot * cos) + rnd(rotated * sin)), rest), dim=-1)


def qk_norm_rope_reference(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           eps: float) -> torch.Tensor:
    """``(B, S, heads, D)`` bf16 -> like ``x``: ``F.rms_norm`` over D, then diffusers' rotary step."""
    y = F.rms_norm(x, (x.shape[-1],), weight, eps)
    return _rope(y, cos, sin, lambda v: v).contiguous()


def qk_norm_rope_golden(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        eps: float, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """FP64 with BF16 stores at the normalised value, the cast cos/sin, both products and the sum
    (straight-through); float64 output."""
    x64 = x.double()
    inv_rms = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    y = st_round(x64 * inv_rms * weight.double(), dtype)
    return _rope(y, cos.double(), sin.double(), lambda v: st_round(v, dtype))
