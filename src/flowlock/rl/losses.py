"""GRPO advantages and the two H3 RL losses of verl-omni, with deterministic reductions.

Per-sample terms are elementwise in the sample's own data; every mean goes through
:func:`~flowlock.rl.reduction.fixed_order_mean`, so a sample's term has the same bits in any batch
and the batch loss is repeatable bitwise for a given batch order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flowlock.ops._validate import check_finite_range, check_tensor
from flowlock.rl.reduction import fixed_order_mean


def _positive(name: str, value: object, *, allow_zero: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be a finite {'non-negative' if allow_zero else 'positive'} number, "
                         f"got {value!r}")
    return float(value)


def _batch_mean(values: torch.Tensor) -> torch.Tensor:
    return fixed_order_mean(values.reshape(1, -1))[0]


def grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, *, global_std: bool = True,
                    eps: float = 1e-4, norm_by_std: bool = True) -> torch.Tensor:
    """Group-relative advantages ``(B,)`` float32 (verl's GRPO outcome advantage).

    ``rewards`` ``(B,)`` float32, ``group_ids`` ``(B,)`` int64 (samples of one prompt share an id).
    ``A = (r - mean_group) / (std + eps)``, or ``r - mean_group`` when ``norm_by_std`` is false.
    ``std`` is the unbiased std of the whole batch (``global_std``) or of the sample's group. As
    in verl, a group of one has mean 0 and std 1, and so does the batch std when ``B == 1``.
    Means are fixed-order over the members in ascending batch position.
    """
    check_tensor("rewards", rewards, dtypes=(torch.float32,), ndim=1)
    check_tensor("group_ids", group_ids, dtypes=(torch.int64,), shape=tuple(rewards.shape), device=rewards.device)
    if rewards.shape[0] < 1:
        raise ValueError("rewards must hold at least one sample")
    check_finite_range("rewards", rewards, -math.inf, math.inf)
    eps = _positive("eps", eps, allow_zero=True)

    def mean_std(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = values.shape[0]
        if n == 1:
            return values.new_zeros(()), values.new_ones(())
        mean = _batch_mean(values)
        centred = values - mean
        return mean, torch.sqrt(_batch_mean(centred * centred) * (n / (n - 1)))

    means = torch.empty_like(rewards)
    stds = torch.empty_like(rewards)
    for gid in torch.unique(group_ids).tolist():
        members = (group_ids == gid).nonzero().flatten()
        mean, std = mean_std(rewards[members])
        means[members] = mean
        stds[members] = std
    if global_std:
        stds = mean_std(rewards)[1].expand_as(rewards)
    centred = rewards - means
    return centred / (stds + eps) if norm_by_std else centred


def flow_grpo_terms(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, *,
                    clip_ratio: float = 1e-4, adv_clip_max: float = 5.0) -> torch.Tensor:
    """Per-sample clipped policy terms ``(B,)`` float32 (verl-omni ``FlowGRPOLoss`` before its mean).

    ``A`` clamped to ``±adv_clip_max``; ``ratio = exp(log_prob - old_log_prob)``; term =
    ``max(-A·ratio, -A·clip(ratio, 1 - clip_ratio, 1 + clip_ratio))``. Differentiable to
    ``log_prob``; ``old_log_prob`` and ``advantages`` are treated as constants.
    """
    check_tensor("log_prob", log_prob, dtypes=(torch.float32,), ndim=1)
    shape, device = tuple(log_prob.shape), log_prob.device
    check_tensor("old_log_prob", old_log_prob, dtypes=(torch.float32,), shape=shape, device=device)
    check_tensor("advantages", advantages, dtypes=(torch.float32,), shape=shape, device=device)
    if shape[0] < 1:
        raise ValueError("log_prob must hold at least one sample")
    clip_ratio = _positive("clip_ratio", clip_ratio)
    adv_clip_max = _positive("adv_clip_max", adv_clip_max)
    adv = advantages.detach().clamp(-adv_clip_max, adv_clip_max)
    ratio = torch.exp(log_prob - old_log_prob.detach())
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_ratio, 1.0 + clip_ratio)
    return torch.maximum(unclipped, clipped)


def flow_grpo_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, *,
                   clip_ratio: float = 1e-4, adv_clip_max: float = 5.0) -> torch.Tensor:
    """The FlowGRPO loss: fixed-order mean of :func:`flow_grpo_terms` (0-D float32)."""
    return _batch_mean(flow_grpo_terms(log_prob, old_log_prob, advantages, clip_ratio=clip_ratio,
                                       adv_clip_max=adv_clip_max))


@dataclass(frozen=True)
class NFTLoss:
    """``loss`` = ``policy`` + ``ref_kl_coef``·``kl`` (0-D float64); ``per_sample`` ``(B,)`` float64
    policy terms before the batch mean and the ``adv_clip_max`` scale."""

    loss: torch.Tensor
    policy: torch.Tensor
    kl: torch.Tensor
    per_sample: torch.Tensor


def diffusion_nft_loss(v_theta: torch.Tensor, v_old: torch.Tensor, v_ref: torch.Tensor, x_sigma: torch.Tensor,
                       x0: torch.Tensor, sigma: torch.Tensor, reward_prob: torch.Tensor, *, beta: float,
                       adaptive_weight_min: float = 1e-5, adv_clip_max: float = 5.0,
                       ref_kl_coef: float = 0.0) -> NFTLoss:
    """verl-omni's DiffusionNFT loss for H3.

    Velocities, ``x_sigma`` and ``x0``: ``(B, ...)`` float32; velocities in the H3 (data-ward)
    sign, so ``x̂0 = x_sigma + σ·v`` (identical bits to verl-omni's ``x_sigma - σ·(-v)``).
    ``sigma`` ``(B,)`` float32 in (0, 1]; ``reward_prob`` ``(B,)`` float32 in [0, 1].
    ``v⁺ = β·v_θ + (1 - β)·v_old``, ``v⁻ = (1 + β)·v_old - β·v_θ``; per sample
    ``w± = max(mean|x̂0± - x0|, adaptive_weight_min)`` in float64 without gradient,
    ``L± = mean((x̂0± - x0)² / w±)`` (float64, as verl-omni's promotion gives),
    term ``= (r·L⁺ + (1 - r)·L⁻) / β``; ``policy = mean(term)·adv_clip_max``;
    ``kl = mean((v_θ - v_ref)²)`` over every element. Gradients flow to ``v_theta`` only.
    """
    check_tensor("v_theta", v_theta, dtypes=(torch.float32,))
    if v_theta.ndim < 2 or v_theta.shape[0] < 1:
        raise ValueError(f"v_theta must be (B, ...) with at least 2 dims, got {tuple(v_theta.shape)}")
    shape, device, b = tuple(v_theta.shape), v_theta.device, v_theta.shape[0]
    for name, t in (("v_old", v_old), ("v_ref", v_ref), ("x_sigma", x_sigma), ("x0", x0)):
        check_tensor(name, t, dtypes=(torch.float32,), shape=shape, device=device)
    check_tensor("sigma", sigma, dtypes=(torch.float32,), shape=(b,), device=device)
    check_tensor("reward_prob", reward_prob, dtypes=(torch.float32,), shape=(b,), device=device)
    check_finite_range("sigma", sigma, 0.0, 1.0)
    if bool((sigma <= 0).any()):
        raise ValueError("sigma must be > 0")
    check_finite_range("reward_prob", reward_prob, 0.0, 1.0)
    beta = _positive("beta", beta)
    adaptive_weight_min = _positive("adaptive_weight_min", adaptive_weight_min)
    adv_clip_max = _positive("adv_clip_max", adv_clip_max)
    ref_kl_coef = _positive("ref_kl_coef", ref_kl_coef, allow_zero=True)

    v_old, v_ref, x_sigma, x0 = v_old.detach(), v_ref.detach(), x_sigma.detach(), x0.detach()
    s = sigma.reshape(b, *([1] * (len(shape) - 1)))

    def branch(v: torch.Tensor) -> torch.Tensor:
        diff = (x_sigma + s * v) - x0
        with torch.no_grad():
            w = fixed_order_mean(diff.detach().to(torch.float64).abs().reshape(b, -1)).clamp(min=adaptive_weight_min)
        sq = (diff * diff).to(torch.float64)
        return fixed_order_mean((sq / w.reshape(b, *([1] * (len(shape) - 1)))).reshape(b, -1))

    positive = branch(beta * v_theta + (1.0 - beta) * v_old)
    negative = branch((1.0 + beta) * v_old - beta * v_theta)
    r = reward_prob.detach().to(torch.float64)
    per_sample = (r * positive + (1.0 - r) * negative) / beta
    policy = _batch_mean(per_sample) * adv_clip_max
    dv = v_theta - v_ref
    kl = _batch_mean(fixed_order_mean((dv * dv).reshape(b, -1))).to(torch.float64)
    return NFTLoss(policy + ref_kl_coef * kl, policy, kl, per_sample)
