"""PyTorch spec and FP64 golden of H3's Euler (eta = 0) update.

``x0 = sample + (1 - t)·v`` in the sample's dtype, then ``x_next = r·sample + (1 - r)·x0`` with
``r = sigma_next / sigma`` in float32 (float32 for half-precision samples, as diffusers'
``MiniMaxH3Scheduler.step``), cast back to the sample's dtype. Per-sample ``timestep``/``sigma``/
``sigma_next`` arrive normalised to shape ``(B,)`` and are reshaped here to ``(B, 1, ..., 1)``.
"""

from __future__ import annotations

import torch

from flowlock.ops._rounding import st_round


def _per_sample(v: torch.Tensor, ndim: int) -> torch.Tensor:
    return v.reshape(v.shape + (1,) * (ndim - 1))


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The blend's dtype: float32 for half-precision samples, the sample's own dtype otherwise."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def euler_step_reference(sample: torch.Tensor, velocity: torch.Tensor, timestep: torch.Tensor,
                         sigma: torch.Tensor, sigma_next: torch.Tensor) -> torch.Tensor:
    """diffusers' arithmetic op for op; ``timestep``/``sigma``/``sigma_next`` are ``(B,)`` float32."""
    n = sample.ndim
    sigma_t = _per_sample(1 - timestep.to(sample.dtype), n)
    denoised = sample + sigma_t * velocity
    cdt = compute_dtype(sample.dtype)
    ratio = _per_sample(sigma_next.to(cdt) / sigma.to(cdt), n)
    prev = ratio * sample.to(cdt) + (1.0 - ratio) * denoised.to(cdt)
    return prev.to(sample.dtype)


def euler_step_golden(sample: torch.Tensor, velocity: torch.Tensor, timestep: torch.Tensor,
                      sigma: torch.Tensor, sigma_next: torch.Tensor) -> torch.Tensor:
    """FP64 with diffusers' stored roundings only (straight-through): sigma_t, the product and x0
    in the sample's dtype, the blend's ratio in the compute dtype; float64 output."""
    n, dt = sample.ndim, sample.dtype
    cdt = compute_dtype(dt)
    x, v = sample.double(), velocity.double()
    sigma_t = _per_sample(st_round(1 - st_round(timestep.double(), dt), dt), n)
    denoised = st_round(x + st_round(sigma_t * v, dt), dt)
    ratio = _per_sample(st_round(sigma_next.double() / sigma.double(), cdt), n)
    return ratio * x + (1.0 - ratio) * denoised
