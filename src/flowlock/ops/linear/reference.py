"""PyTorch spec of ``linear`` and its FP64 golden.

``linear_reference`` is the CPU backend of strict mode. It computes ``x @ weight.T + bias`` in
float64 and rounds once to the output dtype, so it is *more* accurate than the Triton kernel (which
accumulates in float32) and is not bitwise equal to it. Float64 accumulation of bf16/fp32 products
makes the rounded result independent of how the backend blocks the sum for realistic data (the
float64 error is far below half a float32 unit), so the reference is batch-invariant on CPU in
practice; it is not a proof for adversarial inputs whose exact sum sits on a rounding boundary.
Gradients follow autograd through the same float64 computation and are rounded once to the
dtype of the input they belong to.
"""

from __future__ import annotations

import torch

from flowlock.ops._rounding import st_round


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``(x (..., K) @ weight (N, K).T + bias (N,))`` in float64, rounded once to ``out_dtype``
    (default ``x.dtype``). Differentiable; returns ``(..., N)``."""
    out = x.double() @ weight.double().T
    if bias is not None:
        out = out + bias.double()
    return out.to(out_dtype or x.dtype)


def linear_golden(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """FP64 golden: exact products and sums in float64, rounded only where the model stores the
    output (``out_dtype``, default ``x.dtype``), straight-through for gradients. Returns float64."""
    out = x.double() @ weight.double().T
    if bias is not None:
        out = out + bias.double()
    return st_round(out, out_dtype or x.dtype)
