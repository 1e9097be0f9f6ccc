"""Public ``final_adaln_out``: validation, then explicit dispatch."""

from __future__ import annotations

import torch

from flowlock.dispatch import backend_for
from flowlock.ops._graph import needs_graph
from flowlock.ops._triton_utils import traced
from flowlock.ops._validate import FLOAT_DTYPES, check_index, check_tensor
from flowlock.ops.adaln.api import check_projection
from flowlock.ops.final_adaln.opaque import final_adaln_out_reference_op
from flowlock.ops.final_adaln.reference import final_adaln_out_reference
from flowlock.ops.final_adaln.triton import FinalAdalnOutFunction, final_forward
from flowlock.ops.rms_norm._tables import check_eps


def final_adaln_out(x: torch.Tensor, temb: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor, timestep_indices: torch.Tensor, eps: float, *,
                    check_indices: bool = True) -> torch.Tensor:
    """diffusers ``norm_out``: ``rms_norm(x) * (1 + scale[ti]) + shift[ti]`` as one autograd node.

    Args:
        x: ``(..., S, H)`` bfloat16, float16 or float32, contiguous (leading dims are samples
            sharing the indices).
        temb: ``(T, E)`` float32 timestep embeddings.
        norm_weight: ``(H,)`` ``norm_out.norm.weight``, of ``x.dtype``.
        weight: ``(2H, E)`` ``norm_out.linear.weight`` (rows: shift, then scale), of ``x.dtype``.
        bias: ``(2H,)`` ``norm_out.linear.bias``, of ``x.dtype``.
        timestep_indices: ``(S,)`` int32/int64 in ``[0, T)`` (timestep rows, not AdaLN rows).
        eps: the RMSNorm epsilon, finite and ``>= 0``.
        check_indices: range-check ``timestep_indices`` (a host readback); ``False`` only for
            indices already validated.

    Returns:
        ``like x``.

    Guarantees: the ``(T, 2H)`` table is ``w(w(silu(temb)) @ weight^T + bias)`` held in FP32, ``w``
    rounding to ``x.dtype`` (as ``adaln_table``); ``1 + scale``, the product and the sum round to
    ``x.dtype`` where diffusers rounds (nowhere for float32); rows pure (batch-invariant), dx
    row-pure; the shift/scale gradients are fixed-order FP32 segmented sums passed unrounded into
    the projection backward; every gradient repeatable.
    """
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.ndim < 2:
        raise ValueError(f"x must be (..., S, H), got shape {tuple(x.shape)}")
    if not x.is_contiguous():
        raise ValueError("x must be contiguous")
    s, h = x.shape[-2], x.shape[-1]
    t, _, h_proj = check_projection(temb, weight, bias, 2)
    if temb.device != x.device:
        raise ValueError(f"temb must be on {x.device}, got {temb.device}")
    if weight.dtype != x.dtype:
        raise TypeError(f"weight must have x's dtype {x.dtype}, got {weight.dtype}")
    if h_proj != h:
        raise ValueError(f"weight must have 2*H = {2 * h} rows for x's H = {h}, got {weight.shape[0]}")
    check_tensor("norm_weight", norm_weight, dtypes=(x.dtype,), shape=(h,), device=x.device)
    if not norm_weight.is_contiguous():
        raise ValueError("norm_weight must be contiguous")
    check_index("timestep_indices", timestep_indices, length=s, upper=t, device=x.device, check_range=check_indices)
    if not timestep_indices.is_contiguous():
        raise ValueError("timestep_indices must be contiguous")
    eps = check_eps(eps)
    # The checks above put every tensor on x's device: the backend follows from x alone.
    if backend_for("final_adaln_out", x) == "reference":
        spec = final_adaln_out_reference_op if traced() else final_adaln_out_reference
        return spec(x, temb, norm_weight, weight, bias, timestep_indices, eps)
    if needs_graph(x, temb, norm_weight, weight, bias):
        return FinalAdalnOutFunction.apply(x, temb, norm_weight, weight, bias, timestep_indices, eps)
    # No gradient can flow: the node's own forward launches, without recording it.
    return final_forward(x, temb, norm_weight, weight, bias, timestep_indices, eps)[2]
