"""qk_norm_rope in fp32 / fp16 / bf16 at every head dim the model can build (16 to 256, non-powers of
two included) with partial RoPE (R = 6 * rope_freq_dim): FP64-golden budgets on both backends,
reference bitwise diffusers, batch invariance of the kernel."""

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_minimax_h3 import _apply_rotary_emb

import flowlock
from flowlock.ops.qk_norm_rope import qk_norm_rope
from flowlock.ops.qk_norm_rope.reference import qk_norm_rope_golden
from flowlock.testing import assert_batch_invariant, assert_bitwise_equal, assert_within_budget

EPS = 1e-6
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# (head dim, rope_freq_dim): H3 rotates 6 * rope_freq_dim leading channels of each head
HEADS = ((16, 2), (32, 1), (48, 8), (64, 4), (128, 16), (256, 16))


def _inputs(b, s, heads, d, r, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(b, s, heads, d, generator=g) * 3).to(dtype)
    w = (torch.randn(d, generator=g) * 0.3 + 1).to(dtype)
    angles = torch.arange(s, dtype=torch.float32)[:, None] * torch.rand(r // 2, generator=g)[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return x, w, angles.cos(), angles.sin()


def _diffusers(x, w, cos, sin):
    # nn.RMSNorm's forward, on w itself so the baseline has a weight gradient too
    return _apply_rotary_emb(F.rms_norm(x, (x.shape[-1],), w, EPS), cos, sin)


def _grads(fn, x, w, cos, sin, grad):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = fn(x, w, cos, sin)
    out.backward(grad.to(out.dtype))
    return out.detach(), x.grad, w.grad


def _backend(name):
    def fn(x, w, cos, sin):
        with flowlock.use_backend(name):
            return qk_norm_rope(x, w, cos, sin, EPS)
    return fn


# the interpreter is slow: the kernel runs the end points, a non-power of two and H3's own head
CASES = [(b, *h) for h in HEADS for b in ("reference", "triton") if b == "reference" or h[0] in (16, 48, 128, 256)]


@pytest.mark.parametrize("backend, d, freq", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_within_fp64_budget(dtype, backend, d, freq):
    x, w, cos, sin = _inputs(1, 5, 2, d, 6 * freq, dtype, seed=d)
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    got = _grads(_backend(backend), x, w, cos, sin, grad)
    base = _grads(_diffusers, x, w, cos, sin, grad)
    gold = _grads(lambda *a: qk_norm_rope_golden(*a, EPS, dtype), x.double(), w.double(), cos, sin, grad)
    for name, a, bl, gd in zip(("out", "dx", "dweight"), got, base, gold):
        assert a.dtype == dtype
        assert_within_budget(a, gd, baseline=bl, what=f"{name} {dtype} D={d}")


@pytest.mark.parametrize("d, freq", ((16, 2), (80, 8)))
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16))
def test_reference_bitwise_diffusers(dtype, d, freq):
    x, w, cos, sin = _inputs(2, 7, 3, d, 6 * freq, dtype, seed=4)
    assert_bitwise_equal(qk_norm_rope(x, w, cos, sin, EPS), _diffusers(x, w, cos, sin))


@pytest.mark.parametrize("dtype, d, freq", ((torch.float32, 80, 8), (torch.float16, 16, 2)))
def test_batch_invariant(dtype, d, freq):
    x, w, cos, sin = _inputs(7, 2, 2, d, 6 * freq, dtype, seed=5)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(6)).to(dtype)
    # per-sample cotangent rows travel with their sample; the weight gradient is a batch sum, so only
    # the forward and dx are per-sample quantities
    assert_batch_invariant(lambda xs, gs: _grads(_backend("triton"), xs, w, cos, sin, gs)[:2], (x, g),
                           sizes=(2, 7))
