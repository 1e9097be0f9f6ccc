"""Public ``swiglu``: validation, then dispatch."""

from __future__ import annotations

import torch

from flowlock.dispatch import backend_for
from flowlock.ops._graph import needs_graph
from flowlock.ops._triton_utils import traced
from flowlock.ops._validate import FLOAT_DTYPES, check_tensor
from flowlock.ops.swiglu.opaque import swiglu_reference_op
from flowlock.ops.swiglu.reference import swiglu_reference
from flowlock.ops.swiglu.triton import SwigluFunction, swiglu_forward


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """diffusers' SwiGLU activation: ``h[..., :F] * silu(h[..., F:])`` (value first, gate second).

    Args:
        h: ``(..., 2F)`` float32, bfloat16 or float16, contiguous, ``F >= 1``: the output of
            ``ff.net.0.proj``.

    Returns ``(..., F)`` of ``h.dtype``, bitwise equal to diffusers' eager expression on the GPU (SiLU
    in float32 stored in ``h.dtype``, then the product stored in ``h.dtype``; for float32 both are
    plain float32). Elementwise: batch-invariant and repeatable. The gradient to ``h`` is computed
    in float32 and rounded once per element to ``h.dtype``.
    """
    check_tensor("h", h, dtypes=FLOAT_DTYPES)
    if h.ndim < 1 or h.shape[-1] == 0 or h.shape[-1] % 2:
        raise ValueError(f"h must have an even, non-zero last dimension, got shape {tuple(h.shape)}")
    if not h.is_contiguous():
        raise ValueError("h must be contiguous")
    if backend_for("swiglu", h) == "reference":
        return (swiglu_reference_op if traced() else swiglu_reference)(h)
    if needs_graph(h):
        return SwigluFunction.apply(h)
    return swiglu_forward(h)
