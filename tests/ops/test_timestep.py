"""timestep_sinusoid and timestep_mlp: diffusers parity, FP64 budgets, pure rows with a planted
failure, repeatability, the channel tree of d t, bad inputs."""

import numpy as np
import pytest
import torch
from diffusers.models.embeddings import TimestepEmbedding, Timesteps
from hypothesis import given, settings
from hypothesis import strategies as st

import flowlock
from flowlock.ops.timestep import timestep_mlp, timestep_sinusoid
from flowlock.ops.timestep.reference import sinusoid_freqs, timestep_mlp_golden, timestep_sinusoid_golden
from flowlock.testing import (
    assert_batch_invariant,
    assert_bitwise_equal,
    assert_repeatable,
    assert_within_budget,
    batch_invariance_failures,
    repeat_failures,
)

K, HIDDEN, EMBED = 256, 45, 27


def _triton(fn, *args):
    with flowlock.use_backend("triton"):
        return fn(*args)


def _diffusers_sinusoid(t):
    return Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0)(t)


t_values = st.lists(st.floats(0.0, 1.0, width=32), min_size=1, max_size=9)


@settings(max_examples=40, deadline=None)
@given(t_values)
def test_sinusoid_reference_bitwise_diffusers_hypothesis(values):
    t = torch.tensor(values, dtype=torch.float32)
    assert_bitwise_equal(timestep_sinusoid(t), _diffusers_sinusoid(t))


@settings(max_examples=40, deadline=None)
@given(t_values)
def test_sinusoid_kernel_takes_diffusers_product_bitwise_hypothesis(values):
    """Interpreted, the kernel applies numpy's sin/cos (no libdevice on CPU) to exactly diffusers'
    float32 argument; on the GPU the same kernel calls CUDA sinf/cosf (see the gpu test)."""
    t = torch.tensor(values, dtype=torch.float32)
    arg = (t[:, None] * sinusoid_freqs(t.device)[None, :]).numpy()
    expected = torch.from_numpy(np.concatenate([np.cos(arg), np.sin(arg)], axis=-1))
    assert_bitwise_equal(_triton(timestep_sinusoid, t), expected)


@pytest.mark.gpu
def test_sinusoid_kernel_bitwise_diffusers_on_cuda():
    t = torch.cat([torch.tensor([0.0, 1.0, 2.0**-130]), torch.rand(4093)]).cuda()
    assert_bitwise_equal(timestep_sinusoid(t), _diffusers_sinusoid(t))


def test_sinusoid_forward_and_grad_within_fp64_budget():
    t = torch.tensor([0.0, 0.013, 0.25, 0.5, 0.77, 0.999, 1.0])
    g = torch.randn(7, 256, generator=torch.Generator().manual_seed(1))

    def run(fn, tt):
        tt = tt.clone().requires_grad_()
        out = fn(tt)
        out.backward(g.to(out.dtype))
        return out.detach(), tt.grad

    out, dt = run(lambda x: _triton(timestep_sinusoid, x), t)
    base_out, base_dt = run(_diffusers_sinusoid, t)
    gold_out, gold_dt = run(timestep_sinusoid_golden, t.double())
    assert_within_budget(out, gold_out, baseline=base_out, what="sinusoid")
    assert_within_budget(dt, gold_dt, baseline=base_dt, what="d t")


def test_sinusoid_grad_is_the_documented_pairwise_tree():
    t = torch.tensor([0.0, 0.3, 1.0])
    g = torch.randn(3, 256, generator=torch.Generator().manual_seed(2))
    tt = t.clone().requires_grad_()
    _triton(timestep_sinusoid, tt).backward(g)
    f = sinusoid_freqs(t.device)
    arg = (t[:, None] * f[None, :]).numpy()
    s, c = torch.from_numpy(np.sin(arg)).double(), torch.from_numpy(np.cos(arg)).double()
    f, g = f.double(), g.double()
    terms = f * (c * g[:, 128:]) - f * (s * g[:, :128])
    while terms.shape[1] > 1:
        pairs = terms.reshape(3, -1, 2)
        terms = pairs[..., 0] + pairs[..., 1]
    assert_bitwise_equal(tt.grad, terms[:, 0].float())


def test_sinusoid_batch_invariant_and_repeatable():
    pool = torch.rand(16, generator=torch.Generator().manual_seed(3))

    def fwd_bwd(t):
        t = t.clone().requires_grad_()
        out = _triton(timestep_sinusoid, t)
        out.backward(torch.ones_like(out))
        return out.detach(), t.grad

    assert_batch_invariant(fwd_bwd, pool)
    assert_repeatable(lambda: fwd_bwd(pool[:5]), runs=5)


# Widths besides H3's 256: diffusers' own H3 test model uses freq_dim 8; 6 and 12 leave the kernel's
# power-of-two block partly masked (3 and 6 frequencies in a block of 4 and 8).
WIDTHS = (2, 6, 8, 12, 256)


@pytest.mark.parametrize("channels", WIDTHS)
def test_sinusoid_any_even_width_bitwise_diffusers(channels):
    t = torch.cat([torch.tensor([0.0, 1.0, 2.0**-130]), torch.rand(6, generator=torch.Generator().manual_seed(4))])
    expected = Timesteps(channels, flip_sin_to_cos=True, downscale_freq_shift=0)(t)
    assert_bitwise_equal(timestep_sinusoid(t, channels=channels), expected)
    # Interpreted: numpy's sin/cos of exactly diffusers' float32 argument (see the hypothesis test).
    arg = (t[:, None] * sinusoid_freqs(t.device, channels // 2)[None, :]).numpy()
    interpreted = torch.from_numpy(np.concatenate([np.cos(arg), np.sin(arg)], axis=-1))
    assert_bitwise_equal(_triton(lambda x: timestep_sinusoid(x, channels=channels), t), interpreted)


@pytest.mark.parametrize("channels", (6, 8))
def test_sinusoid_narrow_grad_within_fp64_budget_and_pure(channels):
    t = torch.tensor([0.0, 0.013, 0.25, 0.5, 0.77, 0.999, 1.0])
    g = torch.randn(7, channels, generator=torch.Generator().manual_seed(1))

    def run(fn, tt):
        tt = tt.clone().requires_grad_()
        out = fn(tt)
        out.backward(g[: tt.shape[0]].to(out.dtype))
        return out.detach(), tt.grad

    out, dt = run(lambda x: _triton(lambda y: timestep_sinusoid(y, channels=channels), x), t)
    base_out, base_dt = run(Timesteps(channels, flip_sin_to_cos=True, downscale_freq_shift=0), t)
    gold_out, gold_dt = run(lambda x: timestep_sinusoid_golden(x, channels), t.double())
    assert_within_budget(out, gold_out, baseline=base_out, what=f"sinusoid C={channels}")
    assert_within_budget(dt, gold_dt, baseline=base_dt, what=f"d t C={channels}")

    def fwd_bwd(x):
        x = x.clone().requires_grad_()
        y = _triton(lambda z: timestep_sinusoid(z, channels=channels), x)
        y.backward(torch.ones_like(y))
        return y.detach(), x.grad

    assert_batch_invariant(fwd_bwd, torch.rand(16, generator=torch.Generator().manual_seed(3)))


@pytest.mark.parametrize("channels", (0, 7, -2, 8.0, True, "8"))
def test_sinusoid_bad_channels(channels):
    with pytest.raises(ValueError, match="channels must be an even int"):
        timestep_sinusoid(torch.tensor([0.5]), channels=channels)


def _mlp_params(seed=0, hidden=HIDDEN, embed=EMBED):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(hidden, K, generator=g) / 16, torch.randn(hidden, generator=g),
            torch.randn(embed, hidden, generator=g) / hidden ** 0.5, torch.randn(embed, generator=g))


def _embedder(params):
    w1, b1, w2, b2 = params
    module = TimestepEmbedding(K, w1.shape[0], out_dim=w2.shape[0])
    with torch.no_grad():
        for p, v in zip((module.linear_1.weight, module.linear_1.bias, module.linear_2.weight,
                         module.linear_2.bias), params):
            p.copy_(v)
    return module


def _all_grads(fn, x, params, grad):
    leaves = [x.clone().requires_grad_()] + [p.clone().requires_grad_() for p in params]
    out = fn(*leaves)
    out.backward(grad.to(out.dtype))
    return [out.detach()] + [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("rows", [1, 3, 9])
def test_mlp_forward_and_grads_within_fp64_budget(rows):
    params = _mlp_params(rows)
    x = _triton(timestep_sinusoid, torch.rand(rows, generator=torch.Generator().manual_seed(4)))
    grad = torch.randn(rows, EMBED, generator=torch.Generator().manual_seed(5))
    got = _all_grads(lambda *a: _triton(timestep_mlp, *a), x, params, grad)
    module = _embedder(params)

    def eager(x, w1, b1, w2, b2):
        return torch.nn.functional.linear(torch.nn.functional.silu(torch.nn.functional.linear(x, w1, b1)), w2, b2)

    assert_bitwise_equal(module(x), eager(x, *params))
    base = _all_grads(eager, x, params, grad)
    gold = _all_grads(timestep_mlp_golden, x.double(), [p.double() for p in params], grad)
    names = ("out", "dx", "dw1", "db1", "dw2", "db2")
    for name, a, b, gd in zip(names, got, base, gold):
        assert a.dtype == torch.float32 and a.shape == gd.shape
        assert_within_budget(a, gd, baseline=b, what=name)


def test_mlp_reference_is_golden_rounded():
    params = _mlp_params(6)
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(7))
    golden = timestep_mlp_golden(x.double(), *[p.double() for p in params])
    assert_bitwise_equal(timestep_mlp(x, *params), golden.float())


def test_mlp_rows_pure_and_harness_catches_planted_failure():
    params = _mlp_params(8)
    pool = torch.randn(16, K, generator=torch.Generator().manual_seed(9))

    def fwd_dx(x):
        x = x.clone().requires_grad_()
        out = _triton(timestep_mlp, x, *params)
        out.backward(torch.ones_like(out))
        return out.detach(), x.grad

    assert_batch_invariant(fwd_dx, pool, sizes=(2, 3, 9, 16))

    def planted(x):
        # The K order depends on the batch: big batches sum two K halves separately.
        w1, b1, w2, b2 = params
        if x.shape[0] > 4:
            h = (x[:, :128] @ w1[:, :128].t() + x[:, 128:] @ w1[:, 128:].t()) + b1
        else:
            h = x @ w1.t() + b1
        return (torch.nn.functional.silu(h) @ w2.t() + b2,)

    assert batch_invariance_failures(planted, pool, sizes=(2, 9, 16))


def test_mlp_repeatable_including_weight_grads():
    params = _mlp_params(10)
    x = torch.randn(9, K, generator=torch.Generator().manual_seed(11))
    grad = torch.randn(9, EMBED, generator=torch.Generator().manual_seed(12))
    assert_repeatable(lambda: _all_grads(lambda *a: _triton(timestep_mlp, *a), x, params, grad), runs=4)


def test_repeatability_harness_catches_a_shuffled_row_fold():
    g = torch.randn(9, EMBED, generator=torch.Generator().manual_seed(14))
    a = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(15))
    order = torch.Generator().manual_seed(16)

    def planted():
        rows = torch.randperm(9, generator=order)
        dw = torch.zeros(EMBED, HIDDEN)
        for m in rows:
            dw = dw + g[m, :, None] * a[m, None, :]
        return dw

    assert repeat_failures(planted, runs=4)


def test_mlp_single_slice_epilogues_within_budget_and_rows_pure():
    """K = 20 and E = 13 fit one K slice of the interpreter tiles, so linear_1 (bias + SiLU) and d act
    (SiLU backward) walk K in a single step before their epilogue."""
    g = torch.Generator().manual_seed(18)
    params = (torch.randn(HIDDEN, 20, generator=g) / 4, torch.randn(HIDDEN, generator=g),
              torch.randn(13, HIDDEN, generator=g) / HIDDEN ** 0.5, torch.randn(13, generator=g))
    x = torch.randn(5, 20, generator=g)
    grad = torch.randn(5, 13, generator=g)
    got = _all_grads(lambda *a: _triton(timestep_mlp, *a), x, params, grad)

    def eager(x, w1, b1, w2, b2):
        return torch.nn.functional.linear(torch.nn.functional.silu(torch.nn.functional.linear(x, w1, b1)), w2, b2)

    base = _all_grads(eager, x, params, grad)
    gold = _all_grads(timestep_mlp_golden, x.double(), [p.double() for p in params], grad)
    for name, a, b, gd in zip(("out", "dx", "dw1", "db1", "dw2", "db2"), got, base, gold):
        assert_within_budget(a, gd, baseline=b, what=name)

    def fwd_dx(rows):
        rows = rows.clone().requires_grad_()
        out = _triton(timestep_mlp, rows, *params)
        out.backward(torch.ones_like(out))
        return out.detach(), rows.grad

    assert_batch_invariant(fwd_dx, torch.randn(9, 20, generator=g), sizes=(1, 3, 9))


@pytest.mark.gpu
def test_mlp_rows_pure_on_cuda_at_h3_dims():
    g = torch.Generator().manual_seed(17)
    params = [p.cuda() for p in (torch.randn(5376, 256, generator=g) / 16, torch.randn(5376, generator=g),
                                 torch.randn(2688, 5376, generator=g) / 73, torch.randn(2688, generator=g))]
    pool = timestep_sinusoid(torch.rand(16, generator=g).cuda())
    assert_batch_invariant(lambda x: timestep_mlp(x, *params), pool, sizes=(2, 3, 8, 16))


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("t, exc, match", [
    (torch.tensor([0.5], dtype=torch.bfloat16), TypeError, "t must have dtype"),
    (torch.tensor([0.5], dtype=torch.float64), TypeError, "t must have dtype"),
    (torch.tensor([0.5, 250.0]), ValueError, "t values"),
    (torch.tensor([-0.01]), ValueError, "t values"),
    (torch.tensor([float("nan")]), ValueError, "t values"),
    (torch.tensor([[0.5]]), ValueError, "t must be 1-D"),
    (torch.tensor([0.1, 0.2, 0.3, 0.4])[::2], ValueError, "contiguous"),
    ([0.5], TypeError, "t must be a torch.Tensor"),
])
def test_sinusoid_bad_inputs(backend, t, exc, match):
    before = t.clone() if isinstance(t, torch.Tensor) else None
    with flowlock.use_backend(backend), pytest.raises(exc, match=match):
        timestep_sinusoid(t)
    if before is not None:
        assert_bitwise_equal(t, before)


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("index, bad, exc, match", [
    (0, torch.randn(3, K).double(), TypeError, "x must have dtype"),
    (0, torch.randn(3, K + 1), ValueError, "w1 must have shape"),
    (0, torch.randn(0, K), ValueError, "x must have at least one row"),
    (1, torch.randn(HIDDEN, K).bfloat16(), TypeError, "w1"),
    (1, torch.randn(K, HIDDEN).t(), ValueError, "w1 must be contiguous"),
    (2, torch.randn(HIDDEN + 1), ValueError, "b1 must have shape"),
    (3, torch.randn(EMBED, HIDDEN + 2), ValueError, "w2 must have shape"),
    (4, torch.randn(EMBED, 1), ValueError, "b2 must have shape"),
    (4, torch.randn(EMBED, device="meta"), ValueError, "b2 must be on cpu"),
    (0, torch.randn(K, 3).t(), ValueError, "x must be contiguous"),
    (0, torch.randn(K), ValueError, "x must be 2-D"),
    (0, [[0.0] * K], TypeError, "x must be a torch.Tensor"),
    (2, torch.randn(HIDDEN, device="meta"), ValueError, "b1 must be on cpu"),
    (3, torch.randn(EMBED, HIDDEN).half(), TypeError, "w2"),
    (3, torch.randn(HIDDEN, EMBED).t(), ValueError, "w2 must be contiguous"),
    (4, torch.randn(2 * EMBED)[::2], ValueError, "b2 must be contiguous"),
])
def test_mlp_bad_inputs(backend, index, bad, exc, match):
    """Every bad argument raises before any launch, named by the full checks, whether or not the
    one-expression pre-check is what sent the call there."""
    args = [torch.randn(3, K), *_mlp_params(13)]
    args[index] = bad
    kept = [a for a in args if isinstance(a, torch.Tensor) and a.device.type != "meta"]
    before = [a.clone() for a in kept]
    with flowlock.use_backend(backend), pytest.raises(exc, match=match):
        timestep_mlp(*args)
    assert_bitwise_equal(kept, before)
