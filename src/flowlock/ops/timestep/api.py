"""Public ``timestep_sinusoid`` and ``timestep_mlp``: validation, then dispatch."""

from __future__ import annotations

import torch

from flowlock.dispatch import backend_for
from flowlock.ops._graph import needs_graph
from flowlock.ops._triton_utils import traced
from flowlock.ops._validate import check_finite_range, check_tensor
from flowlock.ops.timestep.opaque import timestep_mlp_reference_op, timestep_sinusoid_reference_op
from flowlock.ops.timestep.reference import timestep_mlp_reference, timestep_sinusoid_reference
from flowlock.ops.timestep.triton import (
    TimestepMlpFunction,
    TimestepMlpNode,
    TimestepSinusoidFunction,
    timestep_mlp_forward,
    timestep_mlp_fwd,
    timestep_sinusoid_forward,
)


def _contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def timestep_sinusoid(t: torch.Tensor, *, channels: int = 256, check_range: bool = True) -> torch.Tensor:
    """H3's timestep embedding: ``(T,)`` float32 in ``[0, 1]`` -> ``(T, channels)`` float32, cos first.

    Bitwise equal to diffusers ``Timesteps(channels, flip_sin_to_cos=True, downscale_freq_shift=0)`` on
    the same device: ``[cos(t·f_k), sin(t·f_k)]`` with diffusers' own float32 frequency table and one
    float32 product. ``channels`` is the model's ``freq_dim`` (256 in H3), any even width >= 2
    (``ValueError`` otherwise; diffusers zero-pads an odd width, which H3 never builds).
    Only float32 ``t`` is accepted (``TypeError`` otherwise): diffusers upcasts with
    ``.float()``, and a bf16 timestep near 1 has already lost ~40% of the relative precision of
    ``sigma = 1 - t`` before that upcast, so a narrower ``t`` is a caller bug, not something to absorb.
    H3 consumes timesteps unscaled: values outside ``[0, 1]`` (e.g. ``t·1000``) or NaN raise
    ``ValueError``; ``check_range=False`` skips that host read-back for callers that validated ``t``
    already (torch.compile cannot trace it: compiled callers pass ``False``; dtype, shape, contiguity
    and device are still checked). Rows are pure; differentiable to ``t`` (float64 channel terms
    summed by a fixed pairwise tree, rounded once).
    """
    if isinstance(channels, bool) or not isinstance(channels, int) or channels < 2 or channels % 2:
        raise ValueError(f"channels must be an even int >= 2, got {channels!r}")
    check_tensor("t", t, dtypes=(torch.float32,), ndim=1)
    _contiguous("t", t)
    if check_range:
        check_finite_range("t", t, 0.0, 1.0)
    if backend_for("timestep_sinusoid", t) == "triton":
        # Without a graph to record, the launcher Function.forward calls, minus the apply overhead.
        return TimestepSinusoidFunction.apply(t, channels) if needs_graph(t) else timestep_sinusoid_forward(t, channels)
    return (timestep_sinusoid_reference_op if traced() else timestep_sinusoid_reference)(t, channels)


def timestep_mlp(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
                 b2: torch.Tensor) -> torch.Tensor:
    """H3's ``time_embedder``: ``silu(x @ w1ᵀ + b1) @ w2ᵀ + b2``, all float32, no TF32.

    Args:
        x: ``(T, K)`` float32 (K = 256 for H3), T small (1..8 in H3).
        w1: ``(H, K)`` float32 (H = 5376), b1: ``(H,)`` float32.
        w2: ``(E, H)`` float32 (E = 2688), b2: ``(E,)`` float32. All contiguous, one device.

    Returns ``(T, E)`` float32. Every output row depends only on its input row (one fixed K order per
    element, whatever T is); weight and bias gradients are deterministic ascending sums over the rows.
    """
    if not _mlp_args_valid(x, w1, b1, w2, b2):
        _check_mlp_args(x, w1, b1, w2, b2)
    # The checks put every tensor on x's device: the backend follows from x alone.
    if backend_for("timestep_mlp", x) == "triton":
        if not needs_graph(x, w1, b1, w2, b2):
            return timestep_mlp_forward(x, w1, b1, w2, b2)[0]
        if traced():
            return TimestepMlpFunction.apply(x, w1, b1, w2, b2)
        return TimestepMlpNode.apply(x, w1, b1, w2, b2, timestep_mlp_fwd(x, w1, b1, w2, b2))
    return (timestep_mlp_reference_op if traced() else timestep_mlp_reference)(x, w1, b1, w2, b2)


def _mlp_args_valid(x, w1, b1, w2, b2) -> bool:
    """True when :func:`_check_mlp_args` would pass, as one expression: the time embedding runs once per
    forward, where five separate checks were a tenth of its host time. False sends the call through
    the checks, which name what is wrong (or find it right after all)."""
    f32 = torch.float32
    try:
        dev = x.device
        return (x.dtype is f32 and w1.dtype is f32 and b1.dtype is f32 and w2.dtype is f32 and b2.dtype is f32
                and x.ndim == 2 and x.shape[0] >= 1 and x.shape[1] >= 1
                and w1.ndim == 2 and w1.shape[1] == x.shape[1] and b1.shape == (w1.shape[0],)
                and w2.ndim == 2 and w2.shape[1] == w1.shape[0] and b2.shape == (w2.shape[0],)
                and w1.device == dev and b1.device == dev and w2.device == dev and b2.device == dev
                and x.is_contiguous() and w1.is_contiguous() and b1.is_contiguous() and w2.is_contiguous()
                and b2.is_contiguous())
    except AttributeError:  # not a tensor: the checks say which
        return False


def _check_mlp_args(x, w1, b1, w2, b2) -> None:
    check_tensor("x", x, dtypes=(torch.float32,), ndim=2)
    dev = x.device
    t_rows, k = x.shape
    if t_rows < 1 or k < 1:
        raise ValueError(f"x must have at least one row and one column, got {tuple(x.shape)}")
    check_tensor("w1", w1, dtypes=(torch.float32,), shape=(None, k), device=dev)
    hidden = w1.shape[0]
    check_tensor("b1", b1, dtypes=(torch.float32,), shape=(hidden,), device=dev)
    check_tensor("w2", w2, dtypes=(torch.float32,), shape=(None, hidden), device=dev)
    check_tensor("b2", b2, dtypes=(torch.float32,), shape=(w2.shape[0],), device=dev)
    _contiguous("x", x)
    _contiguous("w1", w1)
    _contiguous("b1", b1)
    _contiguous("w2", w2)
    _contiguous("b2", b2)
