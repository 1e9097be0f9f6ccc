"""PyTorch spec and FP64 golden of diffusers' SwiGLU activation: ``value * silu(gate)``.

``h[..., :F]`` is the value and ``h[..., F:]`` the gate (diffusers ``hidden_states.chunk(2, -1)``).
In eager BF16 / FP16, SiLU is computed in float32 and stored in the input dtype, then the product is
stored in it; in FP32 both steps are plain float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flowlock.ops._rounding import st_round


def swiglu_reference(h: torch.Tensor) -> torch.Tensor:
    """``(..., 2F)`` -> ``(..., F)``: diffusers' expression verbatim."""
    value, gate = h.chunk(2, dim=-1)
    return value * F.silu(gate)


def swiglu_golden(h: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """FP64 with the two stores rounded to ``dtype`` (straight-through); float64 output."""
    value, gate = h.double().chunk(2, dim=-1)
    return st_round(value * st_round(F.silu(gate), dtype), dtype)
