"""Triton kernels for ``euler_step``: one elementwise pass forward and one backward.

Each program derives its sample's scalars from the float32 schedule itself, with diffusers' roundings:
``1 - t`` rounded to the sample dtype (after ``t`` is), ``r = sigma_next / sigma`` as an IEEE
division (``div_rn``, what torch's CUDA division is) and ``1 - r`` in float32, so a call is one
launch rather than one per scalar op. Kernels are launched with ``enable_fp_fusion=False``: eager
PyTorch rounds every product before the add, and an FMA would not.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flowlock.config import config_for
from flowlock.ops._fp_bits import from_f32, round_f32, to_f32
from flowlock.ops._kernel_op import kernel_op
from flowlock.ops._launch import fast_launch
from flowlock.ops._triton_utils import traced

TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _sample_scalars(t_ptr, s_ptr, sn_ptr, b, t_stride, s_stride, sn_stride, DTYPE: tl.constexpr):
    """``(1 - t, r, 1 - r)`` of sample ``b`` as diffusers rounds them (see the module docstring)."""
    t = tl.load(t_ptr + b * t_stride)
    sigma_t = round_f32(1.0 - round_f32(t, DTYPE), DTYPE)
    r = tl.math.div_rn(tl.load(sn_ptr + b * sn_stride), tl.load(s_ptr + b * s_stride))
    return sigma_t, r, 1.0 - r


@fast_launch
@triton.jit
def _euler_step_fwd_kernel(x_ptr, v_ptr, t_ptr, s_ptr, sn_ptr, out_ptr, n_per_sample, t_stride, s_stride,
                           sn_stride, BLOCK: tl.constexpr, DTYPE: tl.constexpr):
    b = tl.program_id(1)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_per_sample
    base = b.to(tl.int64) * n_per_sample
    x = to_f32(tl.load(x_ptr + base + offs, mask=mask, other=0.0))
    v = to_f32(tl.load(v_ptr + base + offs, mask=mask, other=0.0))
    sigma_t, r, omr = _sample_scalars(t_ptr, s_ptr, sn_ptr, b, t_stride, s_stride, sn_stride, DTYPE)
    step = round_f32(sigma_t * v, DTYPE)
    denoised = round_f32(x + step, DTYPE)
    kept = r * x
    moved = omr * denoised
    out = round_f32(kept + moved, DTYPE)
    tl.store(out_ptr + base + offs, from_f32(out, DTYPE), mask=mask)


@fast_launch
@triton.jit
def _euler_step_bwd_kernel(g_ptr, t_ptr, s_ptr, sn_ptr, gx_ptr, gv_ptr, n_per_sample, t_stride, s_stride,
                           sn_stride, BLOCK: tl.constexpr, DTYPE: tl.constexpr):
    b = tl.program_id(1)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_per_sample
    base = b.to(tl.int64) * n_per_sample
    g = to_f32(tl.load(g_ptr + base + offs, mask=mask, other=0.0))
    sigma_t, r, omr = _sample_scalars(t_ptr, s_ptr, sn_ptr, b, t_stride, s_stride, sn_stride, DTYPE)
    g_denoised = omr * g
    gx = r * g + g_denoised
    gv = g_denoised * sigma_t
    tl.store(gx_ptr + base + offs, from_f32(round_f32(gx, DTYPE), DTYPE), mask=mask)
    tl.store(gv_ptr + base + offs, from_f32(round_f32(gv, DTYPE), DTYPE), mask=mask)


def _stride(v: torch.Tensor) -> int:
    """Element stride between samples of a per-sample scalar: 0 for a 0-d one (shared by all)."""
    return v.stride(0) if v.ndim else 0


def euler_step_fwd(sample: torch.Tensor, velocity: torch.Tensor, timestep: torch.Tensor, sigma: torch.Tensor,
                   sigma_next: torch.Tensor) -> torch.Tensor:
    """Trusted launcher: contiguous ``(B, ...)`` sample/velocity; float32 schedule scalars, each 0-d or
    ``(B,)`` (read by stride, never expanded in memory)."""
    out = torch.empty_like(sample)
    n = out.numel()
    if n == 0:
        return out
    per_sample = n // sample.shape[0]
    cfg = config_for("euler_step", sample)
    _euler_step_fwd_kernel[(-(-per_sample // cfg["BLOCK"]), sample.shape[0])](
        sample, velocity, timestep, sigma, sigma_next, out, per_sample, _stride(timestep), _stride(sigma),
        _stride(sigma_next), BLOCK=cfg["BLOCK"], DTYPE=TL_DTYPE[sample.dtype], num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, enable_fp_fusion=False)
    return out


def euler_step_bwd(grad: torch.Tensor, timestep: torch.Tensor, sigma: torch.Tensor,
                   sigma_next: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Trusted launcher: gradients to sample (``r + (1 - r)``) and velocity (``(1 - r)·(1 - t)``)."""
    grad = grad.contiguous()
    gx, gv = torch.empty_like(grad), torch.empty_like(grad)
    n = grad.numel()
    if n == 0:
        return gx, gv
    per_sample = n // grad.shape[0]
    cfg = config_for("euler_step", grad)
    _euler_step_bwd_kernel[(-(-per_sample // cfg["BLOCK"]), grad.shape[0])](
        grad, timestep, sigma, sigma_next, gx, gv, per_sample, _stride(timestep), _stride(sigma),
        _stride(sigma_next), BLOCK=cfg["BLOCK"], DTYPE=TL_DTYPE[grad.dtype], num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, enable_fp_fusion=False)
    return gx, gv


@kernel_op("flowlock::euler_step_fwd")
def _euler_step_fwd_op(sample: torch.Tensor, velocity: torch.Tensor, timestep: torch.Tensor, sigma: torch.Tensor,
                       sigma_next: torch.Tensor) -> torch.Tensor:
    """The step as one opaque op, so torch.compile and CUDA graphs replay the same launch."""
    return euler_step_fwd(sample, velocity, timestep, sigma, sigma_next)


@_euler_step_fwd_op.register_fake
def _(sample, velocity, timestep, sigma, sigma_next):
    return sample.new_empty(sample.shape)


@kernel_op("flowlock::euler_step_bwd")
def _euler_step_bwd_op(grad: torch.Tensor, timestep: torch.Tensor, sigma: torch.Tensor,
                       sigma_next: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d sample, d velocity)`` (see :func:`euler_step_bwd`)."""
    return euler_step_bwd(grad, timestep, sigma, sigma_next)


@_euler_step_bwd_op.register_fake
def _(grad, timestep, sigma, sigma_next):
    return grad.new_empty(grad.shape), grad.new_empty(grad.shape)


def euler_step_forward(sample: torch.Tensor, velocity: torch.Tensor, timestep: torch.Tensor, sigma: torch.Tensor,
                       sigma_next: torch.Tensor) -> torch.Tensor:
    """The forward as every path runs it: the registered custom op while tracing, else the launcher."""
    return (_euler_step_fwd_op if traced() else euler_step_fwd)(sample, velocity, timestep, sigma, sigma_next)


class EulerStepFunction(torch.autograd.Function):
    """Autograd boundary: first-order gradients to ``sample`` and ``velocity`` only (the schedule
    scalars are constants of the sampler)."""

    @staticmethod
    def forward(ctx, sample, velocity, timestep, sigma, sigma_next):
        ctx.save_for_backward(timestep, sigma, sigma_next)
        return euler_step_forward(sample, velocity, timestep, sigma, sigma_next)

    @staticmethod
    def backward(ctx, grad):
        gx, gv = (_euler_step_bwd_op if traced() else euler_step_bwd)(grad, *ctx.saved_tensors)
        return gx, gv, None, None, None
