"""Public ``linear``: validation, then explicit dispatch to Triton (CUDA) or the reference (CPU)."""

from __future__ import annotations

import torch

from flowlock.dispatch import backend_for
from flowlock.ops._graph import needs_graph
from flowlock.ops._triton_utils import traced
from flowlock.ops._validate import check_tensor
from flowlock.ops.linear.opaque import linear_reference_op
from flowlock.ops.linear.reference import linear_reference
from flowlock.ops.linear.triton import (
    LinearFunction,
    linear_dbias,
    linear_dw,
    linear_forward,
    lookup,
    tma_alignment_error,
)

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_OUT_DTYPES = {torch.bfloat16: (torch.bfloat16, torch.float32), torch.float16: (torch.float16, torch.float32),
               torch.float32: (torch.float32,)}


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` with one fixed reduction order per output element.

    Shapes: ``x (..., K)`` (any leading shape, last dim contiguous), ``weight (N, K)`` contiguous,
    ``bias (N,)`` or None -> ``(..., N)``. Dtypes: x, weight and bias all bf16 or all fp16 (output
    in that dtype by default, or fp32 with ``out_dtype=torch.float32``; fp32 accumulation either
    way) or all fp32 (true fp32: no TF32 anywhere).
    Zero rows (``x.numel() == 0``) return an empty tensor without launching (their dW and dBias are
    zeros).

    Triton backend: fp32 accumulation; the bias is added to the fp32 accumulator once after the
    whole K loop, then one rounding. Each output element is computed from its x row and weight row
    in one fixed K order (block size fixed per dtype and architecture), so it is the same bits
    alone or in any batch (M), at any tile position, fused or column-sharded (fused qkv equals
    separate q, k, v; permuting weight rows permutes output columns) and repeatable. Gradients:
    dX reduces over N with the same rule; dW and dBias reduce over tokens in fixed token units
    folded left in fp32 (see ``flowlock.ops.linear.triton``), so they are repeatable and
    reproducible from per-unit partials; they are not batch-invariant (they sum over the batch).

    Reference backend (CPU): float64 accumulation rounded once, more accurate than and not
    bitwise equal to the Triton backend.

    Raises TypeError (wrong type or dtype) or ValueError (shape, device, contiguity, out_dtype,
    or a weight shape the Hopper TMA kernel cannot address) before anything runs.
    """
    out_dtype = _checked(x, weight, bias, out_dtype)
    n, k = weight.shape
    if backend_for("linear", x, weight, bias) == "reference":
        return (linear_reference_op if traced() else linear_reference)(x, weight, bias, out_dtype)
    cfg = lookup("linear_fwd", weight, x, weight)
    if cfg["TMA"]:
        reason = tma_alignment_error(weight, (x.dtype, out_dtype))
        if reason is not None:
            raise ValueError(f"weight: {reason}")
    lead = x.shape[:-1]
    x2d = x.reshape(-1, k)
    if needs_graph(x, weight, bias):
        out = LinearFunction.apply(x2d, weight, bias, out_dtype, cfg)
    else:
        out = linear_forward(x2d, weight, bias, out_dtype, cfg)
    return out.reshape(*lead, n)


def _checked(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None
             ) -> torch.dtype:
    """Raise before anything runs unless ``linear(x, weight, bias, out_dtype=out_dtype)`` is valid; return
    the output dtype."""
    check_tensor("x", x, dtypes=_DTYPES)
    check_tensor("weight", weight, dtypes=_DTYPES, ndim=2)
    if weight.dtype != x.dtype:
        raise TypeError(f"weight must have x's dtype {x.dtype}, got {weight.dtype}")
    n, k = weight.shape
    if n == 0 or k == 0:
        raise ValueError(f"weight must have nonzero N and K, got shape {tuple(weight.shape)}")
    if not weight.is_contiguous():
        raise ValueError("weight must be contiguous")
    if x.ndim < 1 or x.shape[-1] != k:
        raise ValueError(f"x must have shape (..., {k}) to match weight (N, K), got {tuple(x.shape)}")
    if x.stride(-1) != 1 and k > 1:
        raise ValueError(f"x must have a contiguous last dim (stride 1), got stride {x.stride(-1)}")
    if weight.device != x.device:
        raise ValueError(f"weight must be on x's device {x.device}, got {weight.device}")
    if bias is not None:
        check_tensor("bias", bias, dtypes=(x.dtype,), shape=(n,), device=x.device)
        if not bias.is_contiguous():
            raise ValueError("bias must be contiguous")
    if out_dtype is None:
        out_dtype = x.dtype
    if not isinstance(out_dtype, torch.dtype):
        raise TypeError(f"out_dtype must be a torch.dtype or None, got {type(out_dtype).__name__}")
    if out_dtype not in _OUT_DTYPES[x.dtype]:
        raise ValueError(f"out_dtype must be one of {_OUT_DTYPES[x.dtype]} for {x.dtype} inputs, got {out_dtype}")

    return out_dtype


def linear_weight_grad(x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                       *, out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(dW, dBias)`` of ``linear(x, weight, bias, out_dtype=out_dtype)`` for the output gradient ``dy``:
    the bits its backward gives for the same ``x`` and ``dy``, computed without a forward.

    Shapes: ``x (..., K)``, ``dy (..., N)`` with ``x``'s leading shape, in the output dtype; ``dW (N, K)``
    in ``weight``'s dtype, ``dBias (N,)`` in ``bias``'s (None without a bias). For a backward that
    already holds ``x`` and ``dy`` of every row (sequence parallelism gathering a row-sharded layer's
    rows), so that the weight gradient is one process's. Triton: the backward's own dW / dBias kernels
    and configs. Reference: the reference forward's autograd graph run once more on ``x``, so its
    BLAS calls (and bits) are the backward's.
    """
    out_dtype = _checked(x, weight, bias, out_dtype)
    n, k = weight.shape
    lead = x.shape[:-1]
    check_tensor("dy", dy, dtypes=(out_dtype,), shape=(*lead, n), device=x.device)
    if backend_for("linear", x, weight, bias) == "reference":
        leaves = [t.detach().requires_grad_() for t in (weight, bias) if t is not None]
        with torch.enable_grad():
            out = linear_reference(x.detach(), leaves[0], leaves[1] if bias is not None else None, out_dtype)
            grads = torch.autograd.grad(out, leaves, dy)
        return grads[0], (grads[1] if bias is not None else None)
    x2d, dy2d = x.reshape(-1, k), dy.reshape(-1, n).contiguous()
    dw = linear_dw(dy2d, x2d, weight, weight.dtype)
    db = linear_dbias(dy2d, weight, bias.dtype) if bias is not None else None
    return dw, db
