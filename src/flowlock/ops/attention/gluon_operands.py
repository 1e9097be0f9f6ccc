"""Host descriptors of BSHD attention operands for the Gluon kernels (forward and one-pass backward)."""

from __future__ import annotations

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


def bshd_descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """A descriptor over the ``(B, S, heads * D)`` view of a bf16 / fp16 ``(B, S, heads, D)`` operand that
    :func:`flowlock.ops.attention.triton.tma_eligible` accepts, with ``[1, rows, D]`` boxes in the default
    NVMMA shared layout (rows past a sample's end read as zeros)."""
    batch, seq, heads, dim = t.shape
    dt = gl.bfloat16 if t.dtype == torch.bfloat16 else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for([1, rows, dim], dt)
    return TensorDescriptor(t, [batch, seq, heads * dim], [t.stride(0), t.stride(1), 1], [1, rows, dim], layout)
