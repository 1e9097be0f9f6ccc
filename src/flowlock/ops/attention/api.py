"""Public attention: validation for every backend, then explicit dispatch."""

from __future__ import annotations

import math
import numbers

import torch

from flowlock.dispatch import backend_for
from flowlock.ops._graph import needs_graph
from flowlock.ops._triton_utils import traced
from flowlock.ops._validate import FLOAT_DTYPES, check_tensor
from flowlock.ops.attention.opaque import attention_reference_op
from flowlock.ops.attention.reference import attention_reference, default_scale
from flowlock.ops.attention.triton import AttentionFunction, attention_fwd, attention_fwd_op

# Head dims the Triton kernels serve: multiples of 8 (16-byte rows of a 16-bit dtype) from the
# smallest tensor-core K (16) to the largest tile that fits on chip (256); a non-power of two runs
# the next power-of-two tile, masked. The reference serves every head dim.
TRITON_HEAD_DIMS = tuple(range(16, 257, 8))
DTYPES = FLOAT_DTYPES
# grid axis 1 carries sample * head (CUDA caps it at 65535)
MAX_BATCH_HEADS = 65535


def _check_scale(scale: object, head_dim: int) -> float:
    if scale is None:
        return default_scale(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale) or scale <= 0.0:
        raise ValueError(f"scale must be finite and > 0, got {scale}")
    return scale


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None) -> torch.Tensor:
    """Full non-causal softmax attention over one document per sample.

    Args:
        q, k, v: ``(B, S, heads, D)`` of one dtype (bfloat16, float16 or float32) on one device
            (diffusers' BSHD layout), ``B, S, heads >= 1``, ``B * heads <= 65535``; any ``D >= 1`` on
            the reference backend, ``D`` a multiple of 8 in [16, 256] on the Triton backend. Any
            strides, but the last dimension must be contiguous (views of a fused qkv projection are
            accepted without a copy).
        scale: softmax scale, finite and positive; default ``1 / sqrt(D)``.

    Returns:
        ``(B, S, heads, D)`` of ``q.dtype``, contiguous: ``softmax(scale * q k^T) v`` per sample and
        head. Products accumulate in fp32 (true fp32 for float32 inputs: no TF32); the probabilities
        are rounded to ``q.dtype`` before ``P @ V`` and the output once (no rounding for float32).

    Guarantees (Triton backend): each (sample, head, query row) output is a function of that row
    of ``q`` and all of ``k``, ``v`` only, with KV blocks of a frozen size folded in ascending order,
    so outputs are bitwise batch-invariant and row-pure; no atomics, so ``dq``, ``dk``, ``dv`` are
    bitwise repeatable and batch-invariant too. Extra memory O(B * heads * S). The CPU backend is
    the PyTorch reference (same rounding points, not bitwise equal to the kernel). Every check
    below runs before any launch. A call that records no autograd node (grad mode off, or no input
    requiring grad) launches the forward directly: the same kernel, so the same bits. On Hopper the
    kernels read q, k, v through TMA descriptors when their layout allows (see
    ``flowlock.ops.attention.triton.tma_eligible``), through pointers otherwise: same bits.
    """
    check_tensor("q", q, dtypes=DTYPES, ndim=4)
    shape, device = q.shape, q.device
    for name, t in (("k", k), ("v", v)):
        # one comparison chain in the common case; check_tensor names the failing property otherwise
        if not (isinstance(t, torch.Tensor) and t.dtype == q.dtype and t.shape == shape and t.device == device):
            check_tensor(name, t, dtypes=(q.dtype,), shape=tuple(shape), device=device)
    batch, seq, heads, dim = shape
    if batch < 1 or seq < 1 or heads < 1:
        raise ValueError(f"q must have B, S, heads >= 1, got shape {tuple(shape)}")
    if batch * heads > MAX_BATCH_HEADS:
        raise ValueError(f"q must have B * heads <= {MAX_BATCH_HEADS}, got {batch * heads}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension, got strides {t.stride()}")
    scale = _check_scale(scale, dim)
    # k and v are on q's device (checked above), so q alone decides the backend
    if backend_for("attention", q) == "reference":
        return (attention_reference_op if traced() else attention_reference)(q, k, v, scale)
    if dim not in TRITON_HEAD_DIMS:
        raise ValueError(f"q head dim must be a multiple of 8 in [16, 256] on the triton backend (the reference "
                         f"backend takes any), got {dim}")
    if needs_graph(q, k, v):
        return AttentionFunction.apply(q, k, v, scale)
    # no gradient can flow: the forward launcher without an autograd node (same kernel, same bits)
    return (attention_fwd_op if traced() else attention_fwd)(q, k, v, scale)[0]
