"""GRPO advantages, FlowGRPO and DiffusionNFT losses against plain float64 formulas."""

import math

import pytest
import torch

from flowlock.rl.losses import diffusion_nft_loss, flow_grpo_loss, flow_grpo_terms, grpo_advantages
from flowlock.testing import assert_batch_invariant, assert_bitwise_equal, assert_repeatable

B = 16


def _rewards(seed=0):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(9, generator=g)
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 5], dtype=torch.int64)  # group 5 has one member
    return rewards, groups


def _advantages_f64(rewards, groups, global_std, eps, norm_by_std):
    r = rewards.double()
    out = torch.zeros_like(r)
    for g in groups.unique():
        idx = groups == g
        n = int(idx.sum())
        mean = r[idx].mean() if n > 1 else torch.tensor(0.0, dtype=torch.float64)
        std = r[idx].std() if n > 1 else torch.tensor(1.0, dtype=torch.float64)
        if global_std:
            std = r.std()
        out[idx] = (r[idx] - mean) / (std + eps) if norm_by_std else r[idx] - mean
    return out


@pytest.mark.parametrize("global_std", [True, False])
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_advantages_match_float64(global_std, norm_by_std):
    rewards, groups = _rewards()
    adv = grpo_advantages(rewards, groups, global_std=global_std, norm_by_std=norm_by_std)
    golden = _advantages_f64(rewards, groups, global_std, 1e-4, norm_by_std)
    assert adv.dtype == torch.float32
    assert (adv.double() - golden).abs().max() < 1e-5 * golden.abs().max()


def test_grpo_advantages_repeatable_and_single_sample():
    rewards, groups = _rewards(1)
    assert_repeatable(lambda: grpo_advantages(rewards, groups), runs=5)
    one = grpo_advantages(torch.tensor([2.0]), torch.tensor([0]))
    assert_bitwise_equal(one, torch.tensor([2.0]) / (1 + 1e-4))


def _grpo_f64(lp, old, adv, clip_ratio, adv_clip_max):
    a = adv.double().clamp(-adv_clip_max, adv_clip_max)
    ratio = torch.exp(lp.double() - old.double())
    return torch.maximum(-a * ratio, -a * ratio.clamp(1 - clip_ratio, 1 + clip_ratio))


def _grpo_inputs(seed=0, b=B):
    g = torch.Generator().manual_seed(seed)
    lp = torch.randn(b, generator=g) * 0.01
    old = lp + torch.randn(b, generator=g) * 1e-3
    adv = torch.randn(b, generator=g) * 4
    return lp, old, adv


@pytest.mark.parametrize("clip_ratio", [1e-4, 0.2])
def test_flow_grpo_loss_matches_float64(clip_ratio):
    lp, old, adv = _grpo_inputs()
    golden = _grpo_f64(lp, old, adv, clip_ratio, 5.0)
    terms = flow_grpo_terms(lp, old, adv, clip_ratio=clip_ratio)
    assert (terms.double() - golden).abs().max() < 1e-5 * golden.abs().max()
    loss = flow_grpo_loss(lp, old, adv, clip_ratio=clip_ratio)
    assert loss.shape == () and abs(loss.item() - golden.mean().item()) < 1e-5 * golden.abs().max().item()


def test_flow_grpo_gradient_reaches_log_prob_and_terms_are_batch_invariant():
    lp, old, adv = _grpo_inputs(1)
    lp = lp.clone().requires_grad_(True)
    flow_grpo_loss(lp, old, adv, clip_ratio=0.5).backward()
    expected = -adv.clamp(-5, 5) * torch.exp(lp.detach() - old) / B
    assert torch.allclose(lp.grad, expected, rtol=1e-5, atol=0)
    assert_batch_invariant(lambda a, b, c: flow_grpo_terms(a, b, c), _grpo_inputs(2))


def _nft_inputs(seed=0, b=B, shape=(7, 5)):
    g = torch.Generator().manual_seed(seed)
    t = lambda: torch.randn(b, *shape, generator=g)
    x0, eps, v_theta = t(), t(), t()
    v_old = v_theta + 0.1 * t()
    v_ref = v_theta + 0.2 * t()
    sigma = torch.rand(b, generator=g) * 0.9 + 0.05
    x_sigma = (1 - sigma.view(-1, 1, 1)) * x0 + sigma.view(-1, 1, 1) * eps
    reward_prob = torch.rand(b, generator=g)
    return v_theta, v_old, v_ref, x_sigma, x0, sigma, reward_prob


def _nft_f64(v_theta, v_old, v_ref, x_sigma, x0, sigma, r, beta, wmin, adv_clip_max, kl_coef):
    v_theta, v_old, v_ref, x_sigma, x0 = (t.double() for t in (v_theta, v_old, v_ref, x_sigma, x0))
    s = sigma.double().view(-1, 1, 1)
    dims = (1, 2)
    losses = []
    for v in (beta * v_theta + (1 - beta) * v_old, (1 + beta) * v_old - beta * v_theta):
        # verl-omni sign: x0_hat = x_sigma - sigma * v_fm with v_fm = -v_H3.
        d = (x_sigma - s * (-v)) - x0
        w = d.abs().mean(dim=dims, keepdim=True).clamp(min=wmin)
        losses.append((d**2 / w).mean(dim=dims))
    per = (r.double() * losses[0] + (1 - r.double()) * losses[1]) / beta
    return per.mean() * adv_clip_max + kl_coef * ((v_theta - v_ref) ** 2).mean(), per


@pytest.mark.parametrize("beta, kl_coef", [(0.1, 1e-4), (0.5, 0.0)])
def test_nft_loss_matches_float64(beta, kl_coef):
    inputs = _nft_inputs()
    out = diffusion_nft_loss(*inputs, beta=beta, ref_kl_coef=kl_coef)
    golden, per = _nft_f64(*inputs, beta, 1e-5, 5.0, kl_coef)
    assert abs(out.loss.item() - golden.item()) < 1e-5 * abs(golden.item())
    assert (out.per_sample - per).abs().max() < 1e-5 * per.abs().max()


def test_nft_gradient_reaches_v_theta_only():
    v_theta, v_old, *rest = _nft_inputs(1)
    v_theta = v_theta.clone().requires_grad_(True)
    v_old = v_old.clone().requires_grad_(True)
    diffusion_nft_loss(v_theta, v_old, *rest, beta=0.1, ref_kl_coef=1e-4).loss.backward()
    assert v_theta.grad is not None and bool(torch.isfinite(v_theta.grad).all()) and bool(v_theta.grad.abs().sum() > 0)
    assert v_old.grad is None
    # Against autograd of the float64 formula (weights held constant there too: they carry no grad).
    vt64 = v_theta.detach().double().requires_grad_(True)
    inputs = [t.detach() for t in (v_old, *rest)]

    def weightless(vt):
        s = inputs[4].double().view(-1, 1, 1)
        total = 0
        for sign, v in ((1, 0.1 * vt + 0.9 * inputs[0].double()), (-1, 1.1 * inputs[0].double() - 0.1 * vt)):
            d = (inputs[2].double() + s * v) - inputs[3].double()
            w = d.detach().abs().mean(dim=(1, 2), keepdim=True).clamp(min=1e-5)
            r = inputs[5].double() if sign > 0 else 1 - inputs[5].double()
            total = total + r * (d**2 / w).mean(dim=(1, 2))
        return (total / 0.1).mean() * 5.0 + 1e-4 * ((vt - inputs[1].double()) ** 2).mean()

    weightless(vt64).backward()
    assert torch.allclose(v_theta.grad.double(), vt64.grad, rtol=1e-4, atol=1e-9)


def test_nft_per_sample_batch_invariant():
    assert_batch_invariant(lambda *t: (diffusion_nft_loss(*t, beta=0.1).per_sample,), _nft_inputs(2))


@pytest.mark.parametrize("override, error", [
    (dict(log_prob=torch.zeros(B, dtype=torch.float64)), TypeError),
    (dict(old_log_prob=torch.zeros(B - 1)), ValueError),
    (dict(advantages=torch.zeros(B, 1)), ValueError),
    (dict(clip_ratio=0.0), ValueError),
    (dict(adv_clip_max=-1.0), ValueError),
])
def test_grpo_bad_inputs(override, error):
    lp, old, adv = _grpo_inputs()
    kwargs = {**dict(log_prob=lp, old_log_prob=old, advantages=adv), **override}
    with pytest.raises(error):
        flow_grpo_loss(**kwargs)


@pytest.mark.parametrize("index, bad, error", [
    (0, torch.zeros(B, 7, 5, dtype=torch.bfloat16), TypeError),
    (1, torch.zeros(B, 7, 4), ValueError),
    (5, torch.zeros(B, 1), ValueError),  # sigma must be (B,)
    (5, torch.zeros(B), ValueError),  # sigma = 0
    (6, torch.full((B,), 1.5), ValueError),  # reward_prob outside [0, 1]
])
def test_nft_bad_inputs_leave_inputs_unchanged(index, bad, error):
    inputs = list(_nft_inputs(3))
    inputs[index] = bad
    snapshot = [t.clone() for t in inputs]
    with pytest.raises(error):
        diffusion_nft_loss(*inputs, beta=0.1)
    for a, b in zip(inputs, snapshot):
        assert_bitwise_equal(a, b)
    with pytest.raises(ValueError):
        diffusion_nft_loss(*_nft_inputs(3), beta=0.0)


@pytest.mark.parametrize("rewards, groups, error", [
    (torch.zeros(4, dtype=torch.float64), torch.zeros(4, dtype=torch.int64), TypeError),
    (torch.zeros(4), torch.zeros(4, dtype=torch.int32), TypeError),
    (torch.zeros(4), torch.zeros(3, dtype=torch.int64), ValueError),
    (torch.tensor([1.0, math.nan]), torch.zeros(2, dtype=torch.int64), ValueError),
])
def test_advantage_bad_inputs(rewards, groups, error):
    with pytest.raises(error):
        grpo_advantages(rewards, groups)
