"""Public ``qk_norm_rope``: validation, then dispatch."""

from __future__ import annotations

import math

import torch

from flowlock.dispatch import backend_for
from flowlock.ops._graph import needs_graph
from flowlock.ops._triton_utils import traced
from flowlock.ops._validate import FLOAT_DTYPES, check_tensor
from flowlock.ops.qk_norm_rope.opaque import qk_norm_rope_reference_op
from flowlock.ops.qk_norm_rope.reference import qk_norm_rope_reference
from flowlock.ops.qk_norm_rope.triton import QkNormRopeFunction, qk_norm_rope_forward


def qk_norm_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """H3's per-head QK RMSNorm followed by rotate-half RoPE on the leading ``R`` channels.

    Args:
        x: ``(B, S, heads, D)`` float32, bfloat16 or float16, contiguous, any ``D >= 2`` on every
            backend (the Triton kernel masks a power-of-two row block): q or k after the projection
            and unflatten.
        weight: ``(D,)`` of ``x.dtype``: ``attn.norm_q.weight`` / ``attn.norm_k.weight``.
        cos, sin: ``(S, R)`` float32, contiguous, ``R`` even and ``2 <= R <= D``: the rope tables
            (``R = 6 * rope_freq_dim``; any such width, so a small ``rope_freq_dim`` rotates a short
            leading part of the head).
        eps: finite float ``> 0``: the RMSNorm epsilon.

    Returns like ``x``: ``nn.RMSNorm`` rounding (float32 ``x·rsqrt(mean(x²)+eps)·w``, one store in
    ``x.dtype``), then diffusers' ``_apply_rotary_emb`` rounding (cos/sin to ``x.dtype``, each product
    and the sum rounded to ``x.dtype``; channels from ``R`` on pass through). For float32 ``x`` every
    step is plain float32. Rows (token, head) are pure: batch-invariant. The
    weight gradient is a deterministic fixed-tile sum, so repeatable.
    """
    check_tensor("x", x, dtypes=FLOAT_DTYPES, ndim=4)
    b, s, heads, d = x.shape
    check_tensor("weight", weight, dtypes=(x.dtype,), shape=(d,), device=x.device)
    check_tensor("cos", cos, dtypes=(torch.float32,), ndim=2, device=x.device)
    r = cos.shape[1]
    if cos.shape[0] != s:
        raise ValueError(f"cos must have shape ({s}, {r}), got {tuple(cos.shape)}")
    check_tensor("sin", sin, dtypes=(torch.float32,), shape=(s, r), device=x.device)
    if r < 2 or r % 2 or r > d:
        raise ValueError(f"cos/sin rotary width must be even and in [2, {d}], got {r}")
    for name, t in (("x", x), ("weight", weight), ("cos", cos), ("sin", sin)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"eps must be a finite number > 0, got {eps!r}")
    if backend_for("qk_norm_rope", x, weight, cos, sin) == "reference":
        return (qk_norm_rope_reference_op if traced() else qk_norm_rope_reference)(x, weight, cos, sin, float(eps))
    if needs_graph(x, weight):
        return QkNormRopeFunction.apply(x, weight, cos, sin, float(eps))
    return qk_norm_rope_forward(x, weight, cos, sin, float(eps))
