"""PyTorch specs and FP64 goldens of H3's timestep path: the sinusoid (256 channels in H3) and the FP32 MLP.

The sinusoid reproduces diffusers ``Timesteps(C, flip_sin_to_cos=True, downscale_freq_shift=0)``
op for op, for any even ``C`` (H3: ``freq_dim`` = 256; diffusers' own test model uses 8). The MLP
(diffusers ``TimestepEmbedding``: linear_1, SiLU, linear_2, all FP32) is specified with float64
accumulation, rounded to float32 at each value the model stores (linear_1 output, SiLU output,
linear_2 output).
"""

from __future__ import annotations

import math

import torch

from flowlock.ops._rounding import st_round

CHANNELS = 256
HALF = CHANNELS // 2
MAX_PERIOD = 10000

_FREQS: dict[tuple[torch.device, int], torch.Tensor] = {}


def sinusoid_freqs(device: torch.device, half: int = HALF) -> torch.Tensor:
    """The ``(half,)`` float32 frequency table (``half`` = channels / 2, 128 in H3), computed on
    ``device`` with diffusers' own ops (so its bits match diffusers on that device) and cached per
    (device, half)."""
    device = torch.device(device)
    key = (device, half)
    if key not in _FREQS:
        exponent = -math.log(MAX_PERIOD) * torch.arange(start=0, end=half, dtype=torch.float32, device=device)
        exponent = exponent / half
        _FREQS[key] = torch.exp(exponent)
    return _FREQS[key]


def timestep_sinusoid_reference(t: torch.Tensor, channels: int = CHANNELS) -> torch.Tensor:
    """``(T,)`` float32 -> ``(T, channels)`` float32, ``[cos(t·f), sin(t·f)]`` with the product in float32."""
    arg = t[:, None] * sinusoid_freqs(t.device, channels // 2)[None, :]
    return torch.cat([torch.cos(arg), torch.sin(arg)], dim=-1)


def timestep_sinusoid_golden(t: torch.Tensor, channels: int = CHANNELS) -> torch.Tensor:
    """FP64 sin/cos of the float32-rounded product (the one value diffusers stores before sin/cos)."""
    freqs = sinusoid_freqs(t.device, channels // 2)
    arg = st_round(t.double()[:, None] * freqs.double()[None, :], torch.float32)
    return torch.cat([torch.cos(arg), torch.sin(arg)], dim=-1)


def _linear64(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return x.double() @ w.double().t() + b.double()


def timestep_mlp_reference(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
                           b2: torch.Tensor) -> torch.Tensor:
    """``(T, K)`` float32 -> ``(T, E)`` float32: linear_1, SiLU, linear_2, each accumulated in float64
    and stored in float32."""
    h = _linear64(x, w1, b1).float()
    a = torch.nn.functional.silu(h.double()).float()
    return _linear64(a, w2, b2).float()


def timestep_mlp_golden(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
                        b2: torch.Tensor) -> torch.Tensor:
    """FP64 with the same three float32 stores, straight-through for gradients; float64 output."""
    h = st_round(_linear64(x, w1, b1), torch.float32)
    a = st_round(torch.nn.functional.silu(h), torch.float32)
    return st_round(_linear64(a, w2, b2), torch.float32)
