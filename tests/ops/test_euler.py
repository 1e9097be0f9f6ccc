"""euler_step: bitwise equality with diffusers' MiniMaxH3Scheduler.step on both backends, gradients
within the FP64 budget, batch invariance (with a planted failure), repeatability and bad inputs."""

import pytest
import torch
from diffusers import MiniMaxH3Scheduler
from hypothesis import given, settings
from hypothesis import strategies as st

import flowlock
from flowlock.ops.euler import euler_step
from flowlock.ops.euler.reference import euler_step_golden, euler_step_reference
from flowlock.testing import (
    assert_batch_invariant,
    assert_bitwise_equal,
    assert_repeatable,
    assert_within_budget,
    batch_invariance_failures,
)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BACKENDS = ("triton", "reference")


def _run(backend, *args):
    with flowlock.use_backend(backend):
        return euler_step(*args)


def _data(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_bitwise_equal_to_diffusers_over_a_schedule(backend, dtype):
    scheduler = MiniMaxH3Scheduler(shift=12.0)
    scheduler.set_timesteps(9)
    sample, _ = _data((2, 3, 7, 5), dtype)
    ours = sample.clone()
    for i, t in enumerate(scheduler.timesteps):
        velocity = _data(sample.shape, dtype, seed=i + 1)[0]
        expected = scheduler.step(velocity, t, sample, return_dict=False)[0]
        got = _run(backend, ours, velocity, t, scheduler.sigmas[i], scheduler.sigmas[i + 1])
        assert_bitwise_equal(got, expected, f"step {i}")
        sample, ours = expected, got


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_bitwise_equal_to_diffusers_on_cuda(dtype):
    scheduler = MiniMaxH3Scheduler(shift=12.0)
    scheduler.set_timesteps(30, device="cuda")
    sample = _data((2, 16, 9, 24, 40), dtype)[0].cuda()
    for i, t in enumerate(scheduler.timesteps):
        velocity = _data(sample.shape, dtype, seed=i + 1)[0].cuda()
        got = euler_step(sample, velocity, t, scheduler.sigmas[i], scheduler.sigmas[i + 1])
        expected = scheduler.step(velocity, t, sample, return_dict=False)[0]
        assert_bitwise_equal(got, expected, f"step {i}")
        sample = expected


def _diffusers_step(velocity, t, sample, sigma, sigma_next):
    scheduler = MiniMaxH3Scheduler()
    scheduler.set_timesteps(sigmas=[1.0, 0.0])
    scheduler.sigmas = torch.stack([sigma, sigma_next])
    scheduler.timesteps = t.reshape(1)
    return scheduler.step(velocity, t, sample, return_dict=False)[0]


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(DTYPES), st.integers(1, 4), st.integers(1, 40), st.integers(0, 2**31 - 1),
       st.floats(0.0, 1.0, width=32), st.floats(2.0**-20, 1.0, width=32), st.floats(0.0, 1.0))
def test_per_sample_schedule_bitwise_hypothesis(dtype, batch, width, seed, t0, sigma0, frac):
    """Per-sample (B,) schedules equal diffusers run one sample at a time; Triton equals the reference."""
    sample, velocity = _data((batch, width), dtype, seed)
    g = torch.Generator().manual_seed(seed)
    t = (torch.rand(batch, generator=g) * t0).float()
    t[0] = t0
    sigma = (torch.rand(batch, generator=g) * sigma0).clamp_min(1e-6).float()
    sigma[0] = sigma0
    sigma_next = (sigma * frac).float()
    triton_out = _run("triton", sample, velocity, t, sigma, sigma_next)
    assert_bitwise_equal(triton_out, _run("reference", sample, velocity, t, sigma, sigma_next))
    for b in range(batch):
        expected = _diffusers_step(velocity[b:b + 1], t[b], sample[b:b + 1], sigma[b], sigma_next[b])
        assert_bitwise_equal(triton_out[b:b + 1], expected, f"sample {b}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_scalar_and_strided_schedules_read_by_stride(dtype):
    """0-d and strided (B,) schedule tensors mixed: the kernels read them by stride (no expanded
    copies); forward and gradients bitwise those of contiguous (B,) schedules, forward bitwise the
    reference's."""
    sample, velocity = _data((3, 9), dtype, 21)
    t = torch.tensor(0.4)
    sigma = torch.tensor([0.7, 0.0, 0.6, 0.0, 0.5, 0.0])[::2]
    sigma_next = torch.tensor(0.3)
    results = []
    for schedule in ((t, sigma, sigma_next), (t.expand(3).contiguous(), sigma.contiguous(),
                                              sigma_next.expand(3).contiguous())):
        x, v = sample.clone().requires_grad_(), velocity.clone().requires_grad_()
        out = _run("triton", x, v, *schedule)
        out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(dtype))
        results.append((out.detach(), x.grad, v.grad))
    assert_bitwise_equal(results[0], results[1])
    assert_bitwise_equal(results[0][0], _run("reference", sample, velocity, t, sigma, sigma_next))


def test_square_sample_per_sample_sigma_does_not_broadcast_over_channels():
    """sample (R, C) with R == C and a (R,) sigma: each row gets its own sigma (dim 0), as diffusers
    run per sample; a channel-wise broadcast would differ."""
    sample, velocity = _data((6, 6), torch.float32, 3)
    t = torch.linspace(0.1, 0.9, 6)
    sigma = 1 - t
    sigma_next = sigma * 0.5
    out = _run("triton", sample, velocity, t, sigma, sigma_next)
    for b in range(6):
        assert_bitwise_equal(out[b:b + 1], _diffusers_step(velocity[b:b + 1], t[b], sample[b:b + 1],
                                                           sigma[b], sigma_next[b]))
    channelwise = sample + (1 - t) * velocity
    assert not torch.equal(out, (sigma_next / sigma) * sample + (1 - sigma_next / sigma) * channelwise)


def test_fused_blend_would_not_be_bitwise():
    """The bitwise tests can see an FMA/reassociated blend: both differ from diffusers on this data."""
    sample, velocity = _data((4, 4096), torch.float32, 5)
    t, sigma, sigma_next = torch.tensor(0.3), torch.tensor(0.7), torch.tensor(0.45)
    expected = _diffusers_step(velocity, t, sample, sigma, sigma_next)
    r = sigma_next / sigma
    x0 = sample + (1 - t) * velocity
    reassociated = x0 + r * (sample - x0)
    fused = (r.double() * sample.double() + (1 - r).double() * x0.double()).float()
    assert not torch.equal(reassociated, expected)
    assert not torch.equal(fused, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_within_fp64_budget(dtype):
    sample, velocity = _data((3, 33), dtype, 7)
    t = torch.tensor([0.2, 0.5, 0.9])
    sigma = 1 - t
    sigma_next = sigma * 0.6
    grad = _data((3, 33), dtype, 8)[0]

    def grads(fn, x, v):
        x, v = x.detach().requires_grad_(), v.detach().requires_grad_()
        fn(x, v).backward(grad.to(x.dtype))
        return x.grad, v.grad

    got = grads(lambda x, v: _run("triton", x, v, t, sigma, sigma_next), sample, velocity)
    base = grads(lambda x, v: euler_step_reference(x, v, t, sigma, sigma_next), sample, velocity)
    gold = grads(lambda x, v: euler_step_golden(x, v, t, sigma, sigma_next), sample.double(), velocity.double())
    for name, a, b, gd in zip(("d_sample", "d_velocity"), got, base, gold):
        assert a.dtype == dtype
        assert_within_budget(a, gd, baseline=b, what=name)


def test_forward_within_fp64_budget():
    sample, velocity = _data((3, 33), torch.bfloat16, 9)
    t, sigma, sigma_next = torch.tensor(0.4), torch.tensor(0.6), torch.tensor(0.2)
    out = _run("triton", sample, velocity, t, sigma, sigma_next)
    gold = euler_step_golden(sample, velocity, t.reshape(1).expand(3), sigma.reshape(1).expand(3),
                             sigma_next.reshape(1).expand(3))
    assert_within_budget(out, gold, baseline=euler_step_reference(sample, velocity, t.expand(3),
                                                                   sigma.expand(3), sigma_next.expand(3)))


def _pool(n=16, dtype=torch.bfloat16):
    sample, velocity = _data((n, 5, 7), dtype, 11)
    t = torch.rand(n, generator=torch.Generator().manual_seed(12))
    return sample, velocity, t, 1 - t + 1e-3, (1 - t) * 0.5


def test_batch_invariant_and_harness_catches_planted_failure():
    assert_batch_invariant(lambda *a: _run("triton", *a), _pool())

    def planted(sample, velocity, t, sigma, sigma_next):
        # A batch-size dependent path: large batches take the reassociated blend.
        out = _run("triton", sample, velocity, t, sigma, sigma_next)
        if sample.shape[0] < 3:
            return out
        cdt = torch.float32
        r = (sigma_next / sigma).reshape(-1, 1, 1)
        x0 = (sample + (1 - t.to(sample.dtype)).reshape(-1, 1, 1) * velocity).to(cdt)
        return (x0 + r * (sample.to(cdt) - x0)).to(sample.dtype)

    assert not batch_invariance_failures(lambda *a: _run("triton", *a), _pool(dtype=torch.float32))
    assert batch_invariance_failures(planted, _pool(dtype=torch.float32))


def test_repeatable_forward_and_backward():
    sample, velocity, t, sigma, sigma_next = _pool(4)

    def run():
        x, v = sample.clone().requires_grad_(), velocity.clone().requires_grad_()
        out = _run("triton", x, v, t, sigma, sigma_next)
        out.backward(torch.ones_like(out))
        return out.detach(), x.grad, v.grad

    assert_repeatable(run, runs=5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mutate, exc, match", [
    (lambda a: a.update(sample=a["sample"].double(), velocity=a["velocity"].double()), TypeError, "sample"),
    (lambda a: a.update(velocity=a["velocity"].float()), TypeError, "velocity"),
    (lambda a: a.update(velocity=a["velocity"][:, :4]), ValueError, "velocity"),
    (lambda a: a.update(sigma=torch.full((7,), 0.5)), ValueError, "sigma"),
    (lambda a: a.update(sigma=torch.full((3, 1), 0.5)), ValueError, "sigma"),
    (lambda a: a.update(sigma=torch.tensor(0.0)), ValueError, "sigma"),
    (lambda a: a.update(sigma=torch.tensor(-0.5)), ValueError, "sigma"),
    (lambda a: a.update(sigma=torch.tensor(0.5, dtype=torch.bfloat16)), TypeError, "sigma"),
    (lambda a: a.update(sigma_next=torch.tensor(0.6)), ValueError, "sigma_next"),
    (lambda a: a.update(sigma_next=torch.tensor(-0.1)), ValueError, "sigma_next"),
    (lambda a: a.update(timestep=torch.tensor(1000.0)), ValueError, "timestep"),
    (lambda a: a.update(timestep=torch.tensor(float("nan"))), ValueError, "timestep"),
    (lambda a: a.update(timestep=0.5), TypeError, "timestep"),
    (lambda a: a.update(sample=a["sample"].t(), velocity=a["velocity"].t()), ValueError, "contiguous"),
    (lambda a: a.update(sample=a["sample"][0, 0]), ValueError, "sample"),
])
def test_bad_inputs_raise_before_launch(backend, mutate, exc, match):
    sample, velocity = _data((3, 7), torch.bfloat16, 13)
    args = dict(sample=sample, velocity=velocity, timestep=torch.tensor(0.5), sigma=torch.tensor(0.5),
                sigma_next=torch.tensor(0.25))
    mutate(args)
    before = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}
    with flowlock.use_backend(backend), pytest.raises(exc, match=match):
        euler_step(**args)
    for k, v in before.items():
        assert_bitwise_equal(args[k], v, k)


@pytest.mark.parametrize("backend", BACKENDS)
def test_schedule_checks_memoized_yet_see_in_place_writes_and_new_partners(backend, monkeypatch):
    """A reused schedule is read back once; an in-place write or a different partner is checked again."""
    from flowlock.ops.euler import api

    sample, velocity = _data((3, 7), torch.bfloat16, 21)
    t, sigma, sigma_next = torch.tensor(0.5), torch.tensor(0.5), torch.tensor(0.25)
    reads = []
    real = api._schedule_error
    monkeypatch.setattr(api, "_schedule_error", lambda *a: reads.append(1) or real(*a))
    with flowlock.use_backend(backend):
        for _ in range(3):
            euler_step(sample, velocity, t, sigma, sigma_next)
        assert len(reads) == 1
        sigma_next.fill_(0.6)
        with pytest.raises(ValueError, match="sigma_next"):
            euler_step(sample, velocity, t, sigma, sigma_next)
        with pytest.raises(ValueError, match="sigma_next"):
            euler_step(sample, velocity, t, sigma, torch.tensor(0.7))
        euler_step(sample, velocity, t, sigma, torch.tensor(0.1))
    assert len(reads) == 4


@pytest.mark.parametrize("dtype", DTYPES)
def test_no_graph_path_gives_the_graph_paths_bits(dtype):
    """Under no_grad (or with no input needing grad) the op calls the forward launcher directly,
    skipping the autograd Function: same kernel, same bits."""
    sample, velocity = _data((2, 3, 11), dtype, 31)
    t, sigma, sigma_next = torch.tensor([0.3, 0.8]), torch.tensor([0.7, 0.25]), torch.tensor([0.5, 0.0])
    with torch.no_grad():
        plain = _run("triton", sample, velocity, t, sigma, sigma_next)
    no_grad_inputs = _run("triton", sample, velocity, t, sigma, sigma_next)
    graph = _run("triton", sample.clone().requires_grad_(), velocity, t, sigma, sigma_next)
    assert plain.grad_fn is None and no_grad_inputs.grad_fn is None and graph.grad_fn is not None
    assert torch.equal(plain, graph.detach()) and torch.equal(no_grad_inputs, plain)


@pytest.mark.parametrize("backend", BACKENDS)
def test_check_schedule_false_skips_only_the_read_back(backend, monkeypatch):
    """A sampler that validated its schedule once passes check_schedule=False: no read-back, the same
    bits; dtype, shape and device checks still run."""
    from flowlock.ops.euler import api

    sample, velocity = _data((3, 7), torch.bfloat16, 41)
    schedule = (torch.tensor([0.2, 0.5, 0.7]), torch.tensor(0.5), torch.tensor(0.25))
    checked = _run(backend, sample, velocity, *[v.clone() for v in schedule])
    reads = []
    real = api._schedule_error
    monkeypatch.setattr(api, "_schedule_error", lambda *a: reads.append(1) or real(*a))
    with flowlock.use_backend(backend):
        unchecked = euler_step(sample, velocity, *[v.clone() for v in schedule], check_schedule=False)
        assert not reads
        assert_bitwise_equal(unchecked, checked)
        with pytest.raises(TypeError, match="sigma"):
            euler_step(sample, velocity, schedule[0], schedule[1].double(), schedule[2], check_schedule=False)
        with pytest.raises(ValueError, match="timestep"):
            euler_step(sample, velocity, torch.full((4,), 0.5), *schedule[1:], check_schedule=False)
