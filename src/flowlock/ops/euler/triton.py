"""Triton kernels for ``euler_step``: one elementwise pass forward and one backward.

The per-sample scalars (``1 - t`` in the sample dtype, ``r`` and ``1 - r`` in float32) are computed
by the launcher with the same torch ops diffusers uses, on the same device, so the kernel only has to
reproduce diffusers' elementwise roundings. Kernels are launched with ``enable_fp_fusion=False``:
eager PyTorch rounds every product before the add, and an FMA would not.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flowlock.config import launch_config
from flowlock.ops._fp_bits import from_f32, round_f32, to_f32
from flowlock.ops._triton_utils import arch_of
from flowlock.ops.euler.reference import compute_dtype

TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _euler_step_fwd_kernel(x_ptr, v_ptr, st_ptr, r_ptr, omr_ptr, out_ptr, n_per_sample, st_stride, r_stride,
                           BLOCK: tl.constexpr, DTYPE: tl.constexpr):
    b = tl.program_id(1)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_per_sample
    base = b.to(tl.int64) * n_per_sample
    x = to_f32(tl.load(x_ptr + base + offs, mask=mask, other=0.0))
    v = to_f32(tl.load(v_ptr + base + offs, mask=mask, other=0.0))
    sigma_t = to_f32(tl.load(st_ptr + b * st_stride))
    r = tl.load(r_ptr + b * r_stride)
    omr = tl.load(omr_ptr + b * r_stride)
    step = round_f32(sigma_t * v, DTYPE)
    denoised = round_f32(x + step, DTYPE)
    kept = r * x
    moved = omr * denoised
    out = round_f32(kept + moved, DTYPE)
    tl.store(out_ptr + base + offs, from_f32(out, DTYPE), mask=mask)


@triton.jit
def _euler_step_bwd_kernel(g_ptr, st_ptr, r_ptr, omr_ptr, gx_ptr, gv_ptr, n_per_sample, st_stride, r_stride,
                           BLOCK: tl.constexpr, DTYPE: tl.constexpr):
    b = tl.program_id(1)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_per_sample
    base = b.to(tl.int64) * n_per_sample
    g = to_f32(tl.load(g_ptr + base + offs, mask=mask, other=0.0))
    sigma_t = to_f32(tl.load(st_ptr + b * st_stride))
    r = tl.load(r_ptr + b * r_stride)
    omr = tl.load(omr_ptr + b * r_stride)
    g_denoised = omr * g
    gx = r * g + g_denoised
    gv = g_denoised * sigma_t
    tl.store(gx_ptr + base + offs, from_f32(round_f32(gx, DTYPE), DTYPE), mask=mask)
    tl.store(gv_ptr + base + offs, from_f32(round_f32(gv, DTYPE), DTYPE), mask=mask)


def step_scalars(dtype: torch.dtype, timestep: torch.Tensor, sigma: torch.Tensor,
                 sigma_next: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(1 - t)`` in ``dtype``, ``r`` and ``1 - r`` in the compute dtype, each 0-d or ``(B,)`` as its
    inputs broadcast (never expanded in memory: the kernels read them by stride), computed with
    diffusers' torch ops so the bits match on every device."""
    cdt = compute_dtype(dtype)
    ratio = sigma_next.to(cdt) / sigma.to(cdt)
    return 1 - timestep.to(dtype), ratio, 1.0 - ratio


def _stride(v: torch.Tensor) -> int:
    """Element stride between samples of a per-sample scalar: 0 for a 0-d one (shared by all)."""
    return v.stride(0) if v.ndim else 0


def _grid(x: torch.Tensor, block: int) -> tuple[int, int]:
    return (triton.cdiv(x[0].numel(), block), x.shape[0])


def euler_step_fwd(sample: torch.Tensor, velocity: torch.Tensor, sigma_t: torch.Tensor, ratio: torch.Tensor,
                   one_minus_ratio: torch.Tensor) -> torch.Tensor:
    """Trusted launcher: contiguous ``(B, ...)`` sample/velocity, ``(B,)`` scalars from :func:`step_scalars`."""
    out = torch.empty_like(sample)
    if out.numel() == 0:
        return out
    cfg = launch_config("euler_step", sample.dtype, arch_of(sample))
    _euler_step_fwd_kernel[_grid(sample, cfg["BLOCK"])](
        sample, velocity, sigma_t, ratio, one_minus_ratio, out, sample[0].numel(), _stride(sigma_t), _stride(ratio),
        BLOCK=cfg["BLOCK"], DTYPE=TL_DTYPE[sample.dtype], num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, enable_fp_fusion=False)
    return out


def euler_step_bwd(grad: torch.Tensor, sigma_t: torch.Tensor, ratio: torch.Tensor,
                   one_minus_ratio: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Trusted launcher: gradients to sample (``r + (1 - r)``) and velocity (``(1 - r)·(1 - t)``)."""
    grad = grad.contiguous()
    gx, gv = torch.empty_like(grad), torch.empty_like(grad)
    if grad.numel() == 0:
        return gx, gv
    cfg = launch_config("euler_step", grad.dtype, arch_of(grad))
    _euler_step_bwd_kernel[_grid(grad, cfg["BLOCK"])](
        grad, sigma_t, ratio, one_minus_ratio, gx, gv, grad[0].numel(), _stride(sigma_t), _stride(ratio),
        BLOCK=cfg["BLOCK"], DTYPE=TL_DTYPE[grad.dtype], num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, enable_fp_fusion=False)
    return gx, gv


class EulerStepFunction(torch.autograd.Function):
    """Autograd boundary: first-order gradients to ``sample`` and ``velocity`` only (the schedule
    scalars are constants of the sampler)."""

    @staticmethod
    def forward(ctx, sample, velocity, timestep, sigma, sigma_next):
        scalars = step_scalars(sample.dtype, timestep, sigma, sigma_next)
        ctx.save_for_backward(*scalars)
        return euler_step_fwd(sample, velocity, *scalars)

    @staticmethod
    def backward(ctx, grad):
        gx, gv = euler_step_bwd(grad, *ctx.saved_tensors)
        return gx, gv, None, None, None
