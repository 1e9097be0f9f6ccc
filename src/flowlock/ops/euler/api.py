"""Public ``euler_step``: validation, then dispatch to Triton or the PyTorch reference."""

from __future__ import annotations

import math

import torch

from flowlock.dispatch import backend_for
from flowlock.ops._graph import needs_graph
from flowlock.ops._triton_utils import traced
from flowlock.ops._validate import FLOAT_DTYPES, check_tensor, memoized_over
from flowlock.ops.euler.opaque import euler_step_reference_op
from flowlock.ops.euler.reference import euler_step_reference
from flowlock.ops.euler.triton import EulerStepFunction, euler_step_forward


def _per_sample_scalar(name: str, v: object, batch: int, device: torch.device) -> torch.Tensor:
    check_tensor(name, v, dtypes=(torch.float32,), device=device)
    if v.ndim != 0 and (v.ndim != 1 or v.shape[0] != batch):
        raise ValueError(f"{name} must be a 0-d tensor or have shape ({batch},) matching sample's dim 0, "
                         f"got {tuple(v.shape)}")
    return v


def _schedule_error(timestep: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor) -> str | None:
    """The first failed schedule check's message, with one host read-back (one stack, one copy) for
    all three tensors: a sync per check would stall the queue once per check."""
    t, s, n = torch.stack(torch.broadcast_tensors(timestep, sigma, sigma_next)).reshape(3, -1).tolist()
    for name, values, lo, hi in (("timestep", t, 0.0, 1.0), ("sigma", s, 0.0, math.inf),
                                 ("sigma_next", n, 0.0, math.inf)):
        bad = next((v for v in values if not (math.isfinite(v) and lo <= v <= hi)), None)
        if bad is not None:
            return f"{name} values must lie in [{lo}, {hi}], found {bad}"
        nonpositive = next((v for v in values if v <= 0), None) if name == "sigma" else None
        if nonpositive is not None:
            return f"sigma must be > 0, found {nonpositive}"
    if any(b > a for a, b in zip(s, n)):
        return "sigma_next must lie in [0, sigma]"
    return None


def _check_schedule(timestep: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor) -> None:
    """Range checks of the schedule scalars, memoized over the three tensors (identity, storage and
    version): a sampler that reuses its schedule tensors pays the read-back once, fresh tensors pay
    one read-back per call."""
    error = memoized_over([timestep, sigma, sigma_next], "euler_schedule",
                          lambda: _schedule_error(timestep, sigma, sigma_next))
    if error is not None:
        raise ValueError(error)


def euler_step(sample: torch.Tensor, velocity: torch.Tensor, timestep: torch.Tensor, sigma: torch.Tensor,
               sigma_next: torch.Tensor, *, check_schedule: bool = True) -> torch.Tensor:
    """One H3 Euler (eta = 0) step, bitwise equal to diffusers ``MiniMaxH3Scheduler.step``.

    Args:
        sample: ``(B, ...)`` float32/bfloat16/float16, contiguous: ``x_t``.
        velocity: like ``sample`` (same shape, dtype, device): the data-ward model output.
        timestep: float32, 0-d or ``(B,)``, in ``[0, 1]``: the timestep the model was conditioned on.
        sigma: float32, 0-d or ``(B,)``, ``> 0``: the grid sigma of this step.
        sigma_next: float32, 0-d or ``(B,)``, in ``[0, sigma]``: the next grid sigma.
        check_schedule: range-check the three schedule tensors (one host read-back unless these
            exact tensors were checked before, unchanged); pass ``False`` only for values already
            validated (a sampler that checked its whole schedule once; torch.compile cannot trace
            the read-back, so compiled callers pass ``False``). Dtype, shape and device are always
            checked.

    A 1-D schedule argument always indexes samples (dim 0 of ``sample``) and is reshaped to
    ``(B, 1, ..., 1)`` explicitly; any other length is a ``ValueError``, never a broadcast over
    channels. Returns ``x_next`` like ``sample``: ``x0 = sample + (1 - t)·v`` rounded in the sample's
    dtype, then ``r·sample + (1 - r)·x0`` with ``r = sigma_next/sigma``, every product and sum rounded
    separately in float32 (the sample's dtype for float32 samples), cast to the sample's dtype.
    Elementwise, so batch-invariant and repeatable. Gradients flow to ``sample`` and ``velocity``.
    """
    check_tensor("sample", sample, dtypes=FLOAT_DTYPES)
    if sample.ndim < 1:
        raise ValueError("sample must have a batch dimension, got a 0-d tensor")
    check_tensor("velocity", velocity, dtypes=(sample.dtype,), shape=tuple(sample.shape), device=sample.device)
    for name, t in (("sample", sample), ("velocity", velocity)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    batch = sample.shape[0]
    timestep = _per_sample_scalar("timestep", timestep, batch, sample.device)
    sigma = _per_sample_scalar("sigma", sigma, batch, sample.device)
    sigma_next = _per_sample_scalar("sigma_next", sigma_next, batch, sample.device)
    if check_schedule:
        _check_schedule(timestep, sigma, sigma_next)
    backend = backend_for("euler_step", sample, velocity, timestep, sigma, sigma_next)
    if backend == "triton":
        if needs_graph(sample, velocity):
            return EulerStepFunction.apply(sample, velocity, timestep, sigma, sigma_next)
        return euler_step_forward(sample, velocity, timestep, sigma, sigma_next)
    spec = euler_step_reference_op if traced() else euler_step_reference
    return spec(sample, velocity, timestep.expand(batch), sigma.expand(batch), sigma_next.expand(batch))
