"""One-modality sampler transitions of MiniMax-H3 with log-probs: ODE (Euler, eta 0), Flow-GRPO SDE, CPS.

Conventions shared by every transition here:

* ``sample``, ``velocity``: ``(B, ...)`` float32, one modality of ``B`` samples. ``velocity`` is
  the H3 model output (data-ward, ``x0 = x + σ·v``); the SDE/CPS formulas are written in the
  diffusers flow-match sign ``m = -v``, as verl-omni does.
* ``sigma``, ``sigma_next``: ``(B,)`` float32 per-sample noise levels, broadcast explicitly as
  ``(B, 1, ...)``; any other shape is rejected (a bare ``[R]`` sigma would broadcast against a
  channel dimension of size ``R``).
* Exactly one of ``noise`` (rollout: ``x' = mean + std·noise``) or ``prev_sample`` (replay: the
  stored next sample) is given, each shaped like ``sample``. The target ``x'`` is detached, so
  ``log_prob`` is differentiable to ``velocity`` through ``mean`` only.
* Every operation is elementwise per sample and per-sample means use
  :func:`~flowlock.rl.reduction.fixed_order_mean`, so all outputs of a sample are the same bits
  alone or in any batch, at any position.

Log-prob flavours (per sample, over this modality's elements; combine modalities with
:func:`joint_log_prob`):

* ``"verl"`` — verl-omni compatible. CPS: ``mean(-(x' - μ)²)``, no ``1/(2 std²)``, no normaliser.
  SDE: the Flow-GRPO density ``mean(-(x' - μ)²/(2 s²)) - log s - log √(2π)``.
* ``"gaussian"`` — the normalised Gaussian density per element, ``mean(-(x' - μ)²/(2 s²)) - log s
  - log √(2π)``, for every transition; needs ``s > 0`` for every sample.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flowlock.ops._validate import check_finite_range, check_tensor, memoized_over
from flowlock.ops.euler import euler_step
from flowlock.rl.ieee_math import log_f64
from flowlock.rl.reduction import fixed_order_mean

FLAVOURS = ("verl", "gaussian")
_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


@dataclass(frozen=True)
class TransitionResult:
    """``next_sample`` and ``mean`` ``(B, ...)`` float32; ``std`` ``(B,)`` float32 (the per-element
    standard deviation of ``next_sample`` given ``mean``); ``log_prob`` ``(B,)`` float32, ``None``
    for the deterministic ODE step."""

    next_sample: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    log_prob: torch.Tensor | None


def _per_sample(t: torch.Tensor, ndim: int) -> torch.Tensor:
    return t.reshape(t.shape[0], *([1] * (ndim - 1)))


def _check_state(sample, velocity, sigma, sigma_next) -> None:
    check_tensor("sample", sample, dtypes=(torch.float32,))
    if sample.ndim < 2 or sample.shape[0] < 1:
        raise ValueError(f"sample must be (B, ...) with B >= 1 and at least 2 dims, got {tuple(sample.shape)}")
    device = sample.device
    check_tensor("velocity", velocity, dtypes=(torch.float32,), shape=tuple(sample.shape), device=device)
    b = sample.shape[0]
    check_tensor("sigma", sigma, dtypes=(torch.float32,), shape=(b,), device=device)
    check_tensor("sigma_next", sigma_next, dtypes=(torch.float32,), shape=(b,), device=device)
    # One host read-back for all the schedule checks, memoized: a sampler reuses its sigma tensors.
    error = memoized_over([sigma, sigma_next], "transition_schedule", lambda: _schedule_error(sigma, sigma_next))
    if error is not None:
        raise ValueError(error)


def _scalar(value: float, device: torch.device) -> torch.Tensor:
    """A 0-d float32 tensor of ``value`` made on ``device`` by a fill: ``torch.tensor(value, device=...)``
    copies from pageable host memory, which stalls the launch queue."""
    return torch.full((), value, dtype=torch.float32, device=device)


def _schedule_error(sigma: torch.Tensor, sigma_next: torch.Tensor) -> str | None:
    """The first failed check's message: both in [0, 1] and finite, sigma > 0, sigma_next <= sigma."""
    s, n = torch.stack([sigma, sigma_next]).tolist()
    for name, values in (("sigma", s), ("sigma_next", n)):
        bad = next((v for v in values if not (math.isfinite(v) and 0.0 <= v <= 1.0)), None)
        if bad is not None:
            return f"{name} values must lie in [0.0, 1.0], found {bad}"
    if any(v <= 0 for v in s):
        return "sigma must be > 0 (a transition starts from a noisy sample)"
    if any(b > a for a, b in zip(s, n)):
        return "sigma_next must be <= sigma for every sample"
    return None


def _check_target(sample, noise, prev_sample) -> None:
    device = sample.device
    if (noise is None) == (prev_sample is None):
        raise ValueError("give exactly one of noise (rollout) or prev_sample (replay)")
    if noise is not None:
        check_tensor("noise", noise, dtypes=(torch.float32,), shape=tuple(sample.shape), device=device)
    else:
        check_tensor("prev_sample", prev_sample, dtypes=(torch.float32,), shape=tuple(sample.shape),
                     device=device)


def _check_flavour(flavour: object) -> None:
    if flavour not in FLAVOURS:
        raise ValueError(f"flavour must be one of {FLAVOURS}, got {flavour!r}")


def _check_eta(eta: object, hi: float) -> float:
    if isinstance(eta, bool) or not isinstance(eta, (int, float)) or not math.isfinite(eta) or not 0.0 <= eta <= hi:
        raise ValueError(f"eta must be a number in [0, {hi}], got {eta!r}")
    return float(eta)


def _gaussian_log_prob(diff: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    if bool((std <= 0).any()):
        raise ValueError("the gaussian log-prob needs std > 0 for every sample (eta > 0 and a noisy target)")
    b = diff.shape[0]
    var2 = _per_sample(std * std * 2.0, diff.ndim)
    quad = fixed_order_mean((-(diff * diff) / var2).reshape(b, -1))
    # log std through the device-independent float64 log, rounded once: the same bits on any engine.
    log_std = log_f64(std.detach().to(torch.float64)).to(torch.float32)
    return quad - (log_std + _HALF_LOG_2PI)


def _finish(mean: torch.Tensor, std: torch.Tensor, noise, prev_sample, flavour: str, verl_unnormalised: bool):
    if noise is not None:
        next_sample = mean.detach() + _per_sample(std, mean.ndim) * noise
    else:
        next_sample = prev_sample
    diff = next_sample.detach() - mean
    if flavour == "verl" and verl_unnormalised:
        log_prob = fixed_order_mean((-(diff * diff)).reshape(diff.shape[0], -1))
    else:
        log_prob = _gaussian_log_prob(diff, std)
    return TransitionResult(next_sample, mean, std, log_prob)


def cps_step(sample: torch.Tensor, velocity: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor, *,
             eta: float, noise: torch.Tensor | None = None, prev_sample: torch.Tensor | None = None,
             flavour: str = "verl") -> TransitionResult:
    """Coefficients-preserving sampling, exactly verl-omni's ``sde_type="cps"`` (FP32).

    With ``m = -velocity``: ``std = σ'·sin(η·π/2)``, ``x̂0 = x - σ·m``, ``x̂1 = x + (1 - σ)·m``,
    ``μ = (1 - σ')·x̂0 + sqrt(σ'² - std²)·x̂1``, ``x' = μ + std·ξ``. ``eta`` in [0, 1].
    """
    _check_state(sample, velocity, sigma, sigma_next)
    _check_target(sample, noise, prev_sample)
    _check_flavour(flavour)
    eta = _check_eta(eta, 1.0)
    n = sample.ndim
    m = -velocity
    # sin is evaluated once on the host in float64 and rounded: the same float32 on every device.
    std = sigma_next * _scalar(math.sin(eta * math.pi / 2), sample.device)
    s = _per_sample(sigma, n)
    x0_hat = sample - s * m
    x1_hat = sample + (1.0 - s) * m
    coef = torch.sqrt(sigma_next * sigma_next - std * std)
    mean = (1.0 - _per_sample(sigma_next, n)) * x0_hat + _per_sample(coef, n) * x1_hat
    return _finish(mean, std, noise, prev_sample, flavour, verl_unnormalised=True)


def sde_step(sample: torch.Tensor, velocity: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor, *,
             eta: float, sigma_cap: torch.Tensor, noise: torch.Tensor | None = None,
             prev_sample: torch.Tensor | None = None, flavour: str = "verl") -> TransitionResult:
    """The Flow-GRPO SDE step (arXiv 2505.05470) in FP32.

    With ``m = -velocity``, ``dt = σ' - σ``, ``σ̃ = sigma_cap`` where ``σ == 1`` else ``σ``:
    ``std_t = η·sqrt(σ / (1 - σ̃))``, ``μ = x·(1 + std_t²·dt/(2σ)) + m·(1 + std_t²·(1 - σ)/(2σ))·dt``,
    ``s = std_t·sqrt(-dt)``, ``x' = μ + s·ξ``. ``sigma_cap`` ``(B,)`` float32 in [0, 1) is the value
    Flow-GRPO substitutes at ``σ = 1`` (the grid's second entry). ``eta`` >= 0.
    """
    _check_state(sample, velocity, sigma, sigma_next)
    _check_target(sample, noise, prev_sample)
    _check_flavour(flavour)
    eta = _check_eta(eta, math.inf)
    b = sample.shape[0]
    check_tensor("sigma_cap", sigma_cap, dtypes=(torch.float32,), shape=(b,), device=sample.device)
    check_finite_range("sigma_cap", sigma_cap, 0.0, 1.0)
    if memoized_over([sigma_cap], "reaches_one", lambda: bool((sigma_cap >= 1).any())):
        raise ValueError("sigma_cap must be < 1")
    n = sample.ndim
    m = -velocity
    sigma_tilde = torch.where(sigma == 1.0, sigma_cap, sigma)
    std_t = torch.sqrt(sigma / (1.0 - sigma_tilde)) * _scalar(eta, sample.device)
    dt = sigma_next - sigma
    var_t = std_t * std_t
    a = 1.0 + var_t * dt / (2.0 * sigma)
    c = (1.0 + var_t * (1.0 - sigma) / (2.0 * sigma)) * dt
    mean = sample * _per_sample(a, n) + m * _per_sample(c, n)
    std = std_t * torch.sqrt(-dt)
    return _finish(mean, std, noise, prev_sample, flavour, verl_unnormalised=False)


def ode_step(sample: torch.Tensor, velocity: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor, *,
             prev_sample: torch.Tensor | None = None) -> TransitionResult:
    """H3's deterministic Euler step (eta 0) through ``flowlock.ops.euler.euler_step``.

    The timestep fed to the op is ``1 - σ`` in float32, the value the model was conditioned on,
    so the result is bitwise equal to ``MiniMaxH3Scheduler.step``. ``std`` is zero and
    ``log_prob`` is ``None`` (a deterministic step has no density). In replay, ``next_sample`` is
    ``prev_sample``; ``mean`` is always the recomputed Euler update.
    """
    _check_state(sample, velocity, sigma, sigma_next)
    if prev_sample is not None:
        _check_target(sample, None, prev_sample)
    # The schedule was checked above (sigma in (0, 1] makes 1 - sigma a valid timestep): skip the op's
    # own read-back, which a fresh 1 - sigma would pay every step.
    mean = euler_step(sample, velocity, 1.0 - sigma, sigma, sigma_next, check_schedule=False)
    next_sample = mean if prev_sample is None else prev_sample
    return TransitionResult(next_sample, mean, torch.zeros_like(sigma), None)


def joint_log_prob(video: torch.Tensor, audio: torch.Tensor, video_elements: int, audio_elements: int, *,
                   flavour: str) -> torch.Tensor:
    """Combine per-modality ``(B,)`` log-probs of one transition into the joint ``(B,)`` float32.

    ``"verl"``: ``0.5·video + 0.5·audio`` (verl-omni's fixed weights, element counts ignored).
    ``"gaussian"``: weighted by element count, ``(n_v·video + n_a·audio) / (n_v + n_a)``, i.e. the
    per-element mean of the joint density.
    """
    _check_flavour(flavour)
    check_tensor("video", video, dtypes=(torch.float32,), ndim=1)
    check_tensor("audio", audio, dtypes=(torch.float32,), shape=tuple(video.shape), device=video.device)
    for name, count in (("video_elements", video_elements), ("audio_elements", audio_elements)):
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"{name} must be a positive int, got {count!r}")
    if flavour == "verl":
        return 0.5 * video + 0.5 * audio
    total = float(video_elements + audio_elements)
    return (video * float(video_elements) + audio * float(audio_elements)) / total
