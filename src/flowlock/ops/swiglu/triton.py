"""Triton kernels for ``swiglu``: elementwise forward and backward over rows of ``2F`` channels.

Forward reproduces eager exactly in the input dtype (bf16, fp16 or fp32): SiLU as ``g / (1 + exp(-g))``
in float32 with CUDA's precise ``expf`` and an IEEE division (what torch's CUDA kernel evaluates),
rounded to the input dtype, then the product rounded to it (both roundings vanish for fp32). The
interpreter has no libdevice and uses numpy's exp. Backward stays in float32 and rounds each
gradient once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from flowlock.config import config_for
from flowlock.dispatch import interpreter_active
from flowlock.ops._fp_bits import from_f32, round_f32, to_f32
from flowlock.ops._kernel_op import kernel_op
from flowlock.ops._launch import fast_launch
from flowlock.ops._triton_utils import traced


@triton.jit
def _sigmoid_parts(gate, INTERPRET: tl.constexpr):
    """``(1 + exp(-gate))`` with the precise exp on the GPU."""
    if INTERPRET:
        e = tl.exp(-gate)
    else:
        e = libdevice.exp(-gate)
    return 1.0 + e


@fast_launch
@triton.jit
def _swiglu_fwd_kernel(h_ptr, out_ptr, F, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    src = h_ptr + row * (2 * F)
    value = to_f32(tl.load(src + cols, mask=mask, other=0.0))
    gate = to_f32(tl.load(src + F + cols, mask=mask, other=0.0))
    dtype = out_ptr.dtype.element_ty
    act = round_f32(tl.math.div_rn(gate, _sigmoid_parts(gate, INTERPRET)), dtype)
    out = round_f32(value * act, dtype)
    tl.store(out_ptr + row * F + cols, from_f32(out, dtype), mask=mask)


@fast_launch
@triton.jit
def _swiglu_bwd_kernel(h_ptr, g_ptr, dh_ptr, F, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    src = h_ptr + row * (2 * F)
    value = to_f32(tl.load(src + cols, mask=mask, other=0.0))
    gate = to_f32(tl.load(src + F + cols, mask=mask, other=0.0))
    grad = to_f32(tl.load(g_ptr + row * F + cols, mask=mask, other=0.0))
    parts = _sigmoid_parts(gate, INTERPRET)
    dtype = dh_ptr.dtype.element_ty
    act = round_f32(tl.math.div_rn(gate, parts), dtype)
    sig = tl.math.div_rn(1.0, parts)
    d_value = grad * act
    d_gate = (grad * value) * (sig * (1.0 + gate * (1.0 - sig)))
    dst = dh_ptr + row * (2 * F)
    tl.store(dst + cols, from_f32(round_f32(d_value, dtype), dtype), mask=mask)
    tl.store(dst + F + cols, from_f32(round_f32(d_gate, dtype), dtype), mask=mask)


def _launch(kernel, h, *tensors):
    f = h.shape[-1] // 2
    rows = h.numel() // h.shape[-1]
    cfg = config_for("swiglu", h)
    if rows and f:
        kernel[(rows, -(-f // cfg["BLOCK"]))](h, *tensors, f, BLOCK=cfg["BLOCK"],
                                                     INTERPRET=interpreter_active(), num_warps=cfg.num_warps,
                                                     num_stages=cfg.num_stages, enable_reflect_ftz=False)


def swiglu_fwd(h: torch.Tensor) -> torch.Tensor:
    """Trusted launcher: contiguous ``(..., 2F)`` bf16 / fp16 / fp32 -> ``(..., F)`` of the same dtype."""
    out = torch.empty(h.shape[:-1] + (h.shape[-1] // 2,), dtype=h.dtype, device=h.device)
    _launch(_swiglu_fwd_kernel, h, out)
    return out


def swiglu_bwd(h: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Trusted launcher: gradient ``(..., 2F)`` to ``h`` = ``[grad·silu(gate), grad·value·silu'(gate)]``."""
    grad = grad.contiguous()
    dh = torch.empty_like(h)
    _launch(_swiglu_bwd_kernel, h, grad, dh)
    return dh


@kernel_op("flowlock::swiglu_fwd")
def _swiglu_fwd_op(h: torch.Tensor) -> torch.Tensor:
    """The forward as one opaque op, so torch.compile and CUDA graphs replay the same launch."""
    return swiglu_fwd(h)


@_swiglu_fwd_op.register_fake
def _(h):
    return h.new_empty(h.shape[:-1] + (h.shape[-1] // 2,))


@kernel_op("flowlock::swiglu_bwd")
def _swiglu_bwd_op(h: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The gradient to ``h`` as one opaque op (see :func:`swiglu_bwd`)."""
    return swiglu_bwd(h, grad)


@_swiglu_bwd_op.register_fake
def _(h, grad):
    return h.new_empty(h.shape)


def swiglu_forward(h: torch.Tensor) -> torch.Tensor:
    """The forward as every path runs it: the registered custom op while tracing, else the launcher."""
    return (_swiglu_fwd_op if traced() else swiglu_fwd)(h)


class SwigluFunction(torch.autograd.Function):
    """Autograd boundary of ``swiglu``."""

    @staticmethod
    def forward(ctx, h):
        ctx.save_for_backward(h)
        return swiglu_forward(h)

    @staticmethod
    def backward(ctx, grad):
        (h,) = ctx.saved_tensors
        return (_swiglu_bwd_op if traced() else swiglu_bwd)(h, grad)
