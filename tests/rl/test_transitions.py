"""CPS / SDE / ODE transitions: verl-omni's formulas, batch invariance, replay, gradients, validation."""

import math

import pytest
import torch
from diffusers import MiniMaxH3Scheduler
from hypothesis import given, settings
from hypothesis import strategies as st

import flowlock
from flowlock.rl.schedules import sigma_grid
from flowlock.rl.transitions import cps_step, joint_log_prob, ode_step, sde_step
from flowlock.testing import (
    assert_batch_invariant,
    assert_bitwise_equal,
    assert_repeatable,
    assert_within_budget,
    batch_invariance_failures,
)

B, ROWS, CH = 16, 7, 5


def _pool(seed=0, b=B, sigma_hi=1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, ROWS, CH, generator=g)
    v = torch.randn(b, ROWS, CH, generator=g)
    xi = torch.randn(b, ROWS, CH, generator=g)
    sigma = (torch.rand(b, generator=g) * 0.8 + 0.2) * sigma_hi
    sigma_next = sigma * torch.rand(b, generator=g)
    return x, v, sigma, sigma_next, xi


def _cps_golden(x, v, sigma, sigma_next, eta, target):
    """verl-omni's CPS in float64 from the same float32 inputs, written independently."""
    x, v, target = x.double(), v.double(), target.double()
    out_mean, out_lp = [], []
    for i in range(x.shape[0]):
        s, sn = float(sigma[i]), float(sigma_next[i])
        m = -v[i]
        std = sn * math.sin(eta * math.pi / 2)
        x0 = x[i] - s * m
        x1 = x[i] + (1 - s) * m
        mu = (1 - sn) * x0 + math.sqrt(max(sn * sn - std * std, 0.0)) * x1
        out_mean.append(mu)
        out_lp.append(-((target[i] - mu) ** 2).mean())
    return torch.stack(out_mean), torch.stack(out_lp)


def _cps_eager_fp32(x, v, sigma, sigma_next, eta, target):
    """A plain float32 implementation, per sample, as a stock framework would write it."""
    means, lps = [], []
    for i in range(x.shape[0]):
        s, sn = sigma[i], sigma_next[i]
        m = -v[i]
        std = sn * math.sin(eta * math.pi / 2)
        mu = (1 - sn) * (x[i] - s * m) + torch.sqrt(sn**2 - std**2) * (x[i] + (1 - s) * m)
        means.append(mu)
        lps.append(-((target[i] - mu) ** 2).mean())
    return torch.stack(means), torch.stack(lps)


@pytest.mark.parametrize("eta", [0.0, 0.3, 0.8, 1.0])
def test_cps_matches_float64_verl_formula(eta):
    x, v, sigma, sigma_next, xi = _pool(1)
    res = cps_step(x, v, sigma, sigma_next, eta=eta, noise=xi)
    golden_mean, _ = _cps_golden(x, v, sigma, sigma_next, eta, res.next_sample)
    base_mean, _ = _cps_eager_fp32(x, v, sigma, sigma_next, eta, res.next_sample)
    assert_within_budget(res.mean, golden_mean, baseline=base_mean, what="mean")
    # Judge the log-prob on a replayed target away from the mean, where it is well conditioned.
    target = res.mean.detach() + 0.5
    rep = cps_step(x, v, sigma, sigma_next, eta=eta, prev_sample=target)
    _, golden_lp = _cps_golden(x, v, sigma, sigma_next, eta, target)
    _, base_lp = _cps_eager_fp32(x, v, sigma, sigma_next, eta, target)
    assert_within_budget(rep.log_prob, golden_lp, baseline=base_lp, what="log_prob")
    expected_std = sigma_next.double() * math.sin(eta * math.pi / 2)
    assert torch.allclose(res.std.double(), expected_std, rtol=2**-23, atol=0)


def test_cps_next_sample_is_mean_plus_std_noise():
    x, v, sigma, sigma_next, xi = _pool(2)
    res = cps_step(x, v, sigma, sigma_next, eta=0.8, noise=xi)
    assert_bitwise_equal(res.next_sample, res.mean + res.std.view(-1, 1, 1) * xi)


def test_replay_with_stored_next_sample_reproduces_log_prob_bits():
    x, v, sigma, sigma_next, xi = _pool(3)
    for flavour in ("verl", "gaussian"):
        roll = cps_step(x, v, sigma, sigma_next, eta=0.7, noise=xi, flavour=flavour)
        rep = cps_step(x, v, sigma, sigma_next, eta=0.7, prev_sample=roll.next_sample.clone(), flavour=flavour)
        assert_bitwise_equal(rep.log_prob, roll.log_prob, flavour)
        assert_bitwise_equal(rep.mean, roll.mean, flavour)


@pytest.mark.parametrize("flavour", ["verl", "gaussian"])
def test_cps_batch_invariant(flavour):
    def fn(x, v, sigma, sigma_next, xi):
        r = cps_step(x, v, sigma, sigma_next, eta=0.8, noise=xi, flavour=flavour)
        return r.next_sample, r.mean, r.std, r.log_prob

    assert_batch_invariant(fn, _pool(4))


def test_sde_batch_invariant_and_replay():
    pool = _pool(5)
    cap = torch.full((B,), 0.9, dtype=torch.float32)

    def fn(x, v, sigma, sigma_next, xi):
        r = sde_step(x, v, sigma, sigma_next, eta=0.7, sigma_cap=cap[: x.shape[0]], noise=xi)
        return r.next_sample, r.mean, r.std, r.log_prob

    assert_batch_invariant(fn, pool)
    x, v, sigma, sigma_next, xi = pool
    roll = sde_step(x, v, sigma, sigma_next, eta=0.7, sigma_cap=cap, noise=xi)
    rep = sde_step(x, v, sigma, sigma_next, eta=0.7, sigma_cap=cap, prev_sample=roll.next_sample)
    assert_bitwise_equal(rep.log_prob, roll.log_prob)


def test_harness_catches_a_batch_dependent_log_prob():
    def planted(x, v, sigma, sigma_next, xi):
        r = cps_step(x, v, sigma, sigma_next, eta=0.8, noise=xi)
        # A batch-wide mean of the residual, as a shared-reduction bug would produce.
        return (r.log_prob + 1e-3 * r.log_prob.mean(),)

    assert batch_invariance_failures(planted, _pool(6))


def test_repeatable():
    x, v, sigma, sigma_next, xi = _pool(7)
    assert_repeatable(lambda: tuple(
        t for t in vars(cps_step(x, v, sigma, sigma_next, eta=0.8, noise=xi)).values()), runs=10)


def test_sde_matches_float64_flow_grpo_formula():
    x, v, sigma, sigma_next, xi = _pool(8)
    sigma[0] = 1.0
    cap = torch.full((B,), 0.95, dtype=torch.float32)
    res = sde_step(x, v, sigma, sigma_next, eta=0.7, sigma_cap=cap, noise=xi)
    means, lps, base_means = [], [], []
    for i in range(B):
        s, sn = float(sigma[i]), float(sigma_next[i])
        st_ = 0.7 * math.sqrt(s / (1 - (0.95 if s == 1.0 else s)))
        dt = sn - s
        m = -v[i].double()
        mu = x[i].double() * (1 + st_**2 / (2 * s) * dt) + m * (1 + st_**2 * (1 - s) / (2 * s)) * dt
        std = st_ * math.sqrt(-dt)
        tgt = res.next_sample[i].double()
        means.append(mu)
        lps.append((-((tgt - mu) ** 2) / (2 * std**2)).mean() - math.log(std) - 0.5 * math.log(2 * math.pi))
        s32, sn32 = sigma[i], sigma_next[i]
        st32 = 0.7 * torch.sqrt(s32 / (1 - (torch.tensor(0.95) if s == 1.0 else s32)))
        base_means.append(x[i] * (1 + st32**2 / (2 * s32) * (sn32 - s32))
                          - v[i] * (1 + st32**2 * (1 - s32) / (2 * s32)) * (sn32 - s32))
    assert_within_budget(res.mean, torch.stack(means), baseline=torch.stack(base_means), what="sde mean")
    golden_lp = torch.stack(lps)
    assert (res.log_prob.double() - golden_lp).abs().max() < 1e-5 * golden_lp.abs().max()


def test_gaussian_flavour_is_the_normalised_density():
    x, v, sigma, sigma_next, xi = _pool(9)
    res = cps_step(x, v, sigma, sigma_next, eta=0.8, noise=xi, flavour="gaussian")
    std = res.std.double().view(-1, 1, 1)
    dens = torch.distributions.Normal(res.mean.double(), std.expand_as(res.mean)).log_prob(res.next_sample.double())
    golden = dens.reshape(B, -1).mean(1)
    assert (res.log_prob.double() - golden).abs().max() < 1e-5 * golden.abs().max()


def test_log_prob_gradient_reaches_the_velocity():
    x, v, sigma, sigma_next, xi = _pool(10)
    target = cps_step(x, v, sigma, sigma_next, eta=0.8, noise=xi).next_sample + 0.25
    v = v.clone().requires_grad_(True)
    res = cps_step(x, v, sigma, sigma_next, eta=0.8, prev_sample=target)
    res.log_prob.sum().backward()
    # d logp / d v = 2 (x' - mu) / N * d mu / d v, with d mu / d v = (1 - s') s - coef (1 - s).
    s, sn = sigma.double().view(-1, 1, 1), sigma_next.double().view(-1, 1, 1)
    coef = torch.sqrt(sn**2 - (sn * math.sin(0.8 * math.pi / 2)) ** 2)
    expected = 2 * (target.double() - res.mean.detach().double()) / (ROWS * CH) * ((1 - sn) * s - coef * (1 - s))
    assert v.grad is not None
    assert torch.allclose(v.grad.double(), expected, rtol=1e-4, atol=1e-9)


def test_sde_log_prob_gradient_reaches_the_velocity():
    x, v, sigma, sigma_next, xi = _pool(11)
    v = v.clone().requires_grad_(True)
    cap = torch.full((B,), 0.9, dtype=torch.float32)
    res = sde_step(x, v, sigma, sigma_next, eta=0.7, sigma_cap=cap, prev_sample=x * 0.5)
    res.log_prob.sum().backward()
    assert v.grad is not None and bool(torch.isfinite(v.grad).all()) and bool((v.grad != 0).all())


def test_joint_log_prob_weights():
    v = torch.tensor([-1.0, -3.0])
    a = torch.tensor([-2.0, -5.0])
    assert_bitwise_equal(joint_log_prob(v, a, 96, 32, flavour="verl"), torch.tensor([-1.5, -4.0]))
    assert_bitwise_equal(joint_log_prob(v, a, 96, 32, flavour="gaussian"), (v * 96 + a * 32) / 128)
    with pytest.raises(ValueError):
        joint_log_prob(v, a, 0, 32, flavour="verl")
    with pytest.raises(ValueError):
        joint_log_prob(v, a, 1, 1, flavour="other")


@settings(max_examples=15, deadline=None)
@given(b=st.integers(2, 5), pos=st.integers(0, 4), eta=st.floats(0.0, 1.0), seed=st.integers(0, 1000))
def test_cps_sample_alone_equals_sample_in_batch(b, pos, eta, seed):
    x, v, sigma, sigma_next, xi = _pool(seed, b=b)
    pos = pos % b
    full = cps_step(x, v, sigma, sigma_next, eta=eta, noise=xi)
    one = cps_step(*(t[pos:pos + 1].clone() for t in (x, v, sigma, sigma_next)), eta=eta, noise=xi[pos:pos + 1])
    assert_bitwise_equal((full.next_sample[pos], full.log_prob[pos]), (one.next_sample[0], one.log_prob[0]))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_ode_step_is_bitwise_diffusers(backend):
    grid = sigma_grid(6, 12.0, convention="grid_points")
    x, v, *_ = _pool(12, b=3)
    for k in range(grid.numel() - 1):
        scheduler = MiniMaxH3Scheduler(shift=12.0)
        scheduler.set_timesteps(6)
        scheduler.set_begin_index(k)
        expected = scheduler.step(v, scheduler.timesteps[k], x).prev_sample
        sigma = grid[k].expand(3).contiguous()
        sigma_next = grid[k + 1].expand(3).contiguous()
        with flowlock.use_backend(backend):
            res = ode_step(x, v, sigma, sigma_next)
            replay = ode_step(x, v, sigma, sigma_next, prev_sample=expected.clone())
        assert_bitwise_equal(res.next_sample, expected, f"step {k}")
        assert_bitwise_equal(replay.mean, expected, f"replay step {k}")
        assert res.log_prob is None and not bool(res.std.any())


def _bad_calls():
    x, v, sigma, sigma_next, xi = _pool(13, b=CH)
    return [
        (dict(sigma=sigma.view(CH, 1)), ValueError),  # (B, 1) is not (B,)
        (dict(sigma=torch.full((ROWS,), 0.5)), ValueError),  # a bare [R] sigma
        (dict(sigma=sigma.double()), TypeError),
        (dict(sample=x.bfloat16()), TypeError),
        (dict(velocity=v[:, :3]), ValueError),
        (dict(sigma=torch.zeros(CH)), ValueError),
        (dict(sigma_next=sigma + 0.1), ValueError),
        (dict(sigma=sigma * float("nan")), ValueError),
        (dict(prev_sample=xi), ValueError),  # noise and prev_sample together
        (dict(noise=None), ValueError),  # neither
        (dict(noise=xi[:, :, :2]), ValueError),
        (dict(eta=1.5), ValueError),
        (dict(eta=True), ValueError),
        (dict(flavour="normalised"), ValueError),
        (dict(flavour="gaussian", eta=0.0), ValueError),  # std = 0 has no density
    ], dict(sample=x, velocity=v, sigma=sigma, sigma_next=sigma_next, noise=xi, eta=0.8)


def test_bad_inputs_raise_and_leave_inputs_unchanged():
    cases, base = _bad_calls()
    for override, error in cases:
        kwargs = {**base, **override}
        snapshot = {k: t.clone() for k, t in kwargs.items() if isinstance(t, torch.Tensor)}
        with pytest.raises(error):
            cps_step(kwargs.pop("sample"), kwargs.pop("velocity"), kwargs.pop("sigma"), kwargs.pop("sigma_next"),
                     **kwargs)
        for k, t in snapshot.items():
            assert_bitwise_equal({**base, **override}[k], t, k)


def test_sde_rejects_bad_sigma_cap():
    x, v, sigma, sigma_next, xi = _pool(14, b=3)
    for cap, error in ((torch.ones(3), ValueError), (torch.full((2,), 0.5), ValueError),
                       (torch.full((3,), 0.5, dtype=torch.float64), TypeError)):
        with pytest.raises(error):
            sde_step(x, v, sigma, sigma_next, eta=0.5, sigma_cap=cap, noise=xi)
    with pytest.raises(ValueError):
        sde_step(x, v, sigma, sigma_next, eta=float("inf"), sigma_cap=torch.full((3,), 0.5), noise=xi)
