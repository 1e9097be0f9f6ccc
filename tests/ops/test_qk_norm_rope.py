"""qk_norm_rope: the reference is diffusers' composition bitwise, the kernel is within the FP64 budget
(forward, dx, dweight), rows are pure (with a planted failure), repeatable, bad inputs rejected."""

import pytest
import torch
from diffusers.models.transformers.transformer_minimax_h3 import _apply_rotary_emb
from hypothesis import given, settings
from hypothesis import strategies as st

import flowlock
from flowlock.ops.qk_norm_rope import qk_norm_rope
from flowlock.ops.qk_norm_rope import triton as qk_triton
from flowlock.ops.qk_norm_rope.reference import qk_norm_rope_golden
from flowlock.ops.segment_sum.fold import fold_group, fold_partials
from flowlock.ops.segment_sum.reference import fold_partials_reference
from flowlock.testing import (
    assert_batch_invariant,
    assert_bitwise_equal,
    assert_repeatable,
    assert_within_budget,
    batch_invariance_failures,
)

EPS = 1e-6


def _inputs(b, s, heads, d, r, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(b, s, heads, d, generator=g) * scale).bfloat16()
    w = (torch.randn(d, generator=g) * 0.3 + 1).bfloat16()
    angles = torch.arange(s, dtype=torch.float32)[:, None] * torch.rand(r // 2, generator=g)[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return x, w, angles.cos(), angles.sin()


def _diffusers(x, w, cos, sin):
    norm = torch.nn.RMSNorm(x.shape[-1], eps=EPS).to(x.dtype)
    with torch.no_grad():
        norm.weight.copy_(w)
    return _apply_rotary_emb(norm(x), cos, sin)


def _triton(x, w, cos, sin):
    with flowlock.use_backend("triton"):
        return qk_norm_rope(x, w, cos, sin, EPS)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 2), st.sampled_from([1, 7, 33]), st.integers(1, 3), st.sampled_from([(8, 8), (24, 16), (40, 24)]),
       st.integers(0, 2**31 - 1), st.sampled_from([0.01, 1.0, 50.0]))
def test_reference_bitwise_diffusers_hypothesis(b, s, heads, dr, seed, scale):
    x, w, cos, sin = _inputs(b, s, heads, *dr, seed, scale)
    assert_bitwise_equal(qk_norm_rope(x, w, cos, sin, EPS), _diffusers(x, w, cos, sin))


def _grads(fn, x, w, cos, sin, grad):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = fn(x, w, cos, sin)
    out.backward(grad.to(out.dtype))
    return out.detach(), x.grad, w.grad


@pytest.mark.parametrize("shape", [(1, 1, 1, 8, 8), (2, 7, 3, 40, 24), (1, 33, 2, 24, 16), (1, 33, 5, 24, 16)])
def test_forward_and_grads_within_fp64_budget(shape):
    x, w, cos, sin = _inputs(*shape, seed=1)
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).bfloat16()
    got = _grads(_triton, x, w, cos, sin, grad)
    base = _grads(_diffusers, x, w, cos, sin, grad)
    gold = _grads(lambda *a: qk_norm_rope_golden(*a, EPS), x.double(), w.double(), cos, sin, grad)
    for name, a, bl, gd in zip(("out", "dx", "dweight"), got, base, gold):
        assert a.dtype == torch.bfloat16
        assert_within_budget(a, gd, baseline=bl, what=name)


def test_forward_mostly_bitwise_diffusers():
    """Not a promise (the kernel's sum of squares has its own order), but eager rounding is matched:
    at most a handful of BF16 ties may flip."""
    x, w, cos, sin = _inputs(2, 17, 3, 40, 24, seed=3)
    out, expected = _triton(x, w, cos, sin), _diffusers(x, w, cos, sin)
    assert int((out != expected).sum()) <= out.numel() // 1000


@pytest.mark.gpu
def test_rows_pure_on_cuda_at_h3_dims():
    x, w, cos, sin = (t.cuda() for t in _inputs(8, 64, 56, 128, 96, seed=7))
    assert_batch_invariant(lambda xb: qk_norm_rope(xb, w, cos, sin, EPS), x, sizes=(2, 3, 8))


def _fwd_dx(x, w, cos, sin):
    x = x.clone().requires_grad_()
    out = _triton(x, w, cos, sin)
    out.backward(torch.ones_like(out))
    return out.detach(), x.grad


def test_rows_pure_and_harness_catches_planted_failure():
    x, w, cos, sin = _inputs(16, 2, 2, 24, 16, seed=4)
    assert_batch_invariant(lambda xb: _fwd_dx(xb, w, cos, sin), x)

    def planted(xb):
        # Large batches normalise with a BF16-rounded inverse RMS.
        if xb.shape[0] < 3:
            return (_triton(xb, w, cos, sin),)
        xf = xb.float()
        inv = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS).bfloat16().float()
        return (_apply_rotary_emb((xf * inv * w.float()).bfloat16(), cos, sin),)

    assert batch_invariance_failures(planted, x)


def test_dweight_is_the_shared_fold_of_tile_partials(monkeypatch):
    """165 rows = 6 interpreter tiles = 2 fold groups: dweight is fold_partials' order, rounded once to bf16."""
    seen = []

    def recording_fold(partials):
        seen.append(partials.clone())
        return fold_partials(partials)

    monkeypatch.setattr(qk_triton, "fold_partials", recording_fold)
    x, w, cos, sin = _inputs(1, 33, 5, 24, 16, seed=8)
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(9)).bfloat16()
    _, _, dweight = _grads(_triton, x, w, cos, sin, grad)
    (partials,) = seen
    assert partials.shape == (6, 24) and 6 > fold_group("interp")
    assert_bitwise_equal(dweight, fold_partials_reference(partials, fold_group("interp")).bfloat16())


def test_repeatable_including_dweight():
    x, w, cos, sin = _inputs(2, 9, 2, 24, 16, seed=5)
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(6)).bfloat16()
    assert_repeatable(lambda: _grads(_triton, x, w, cos, sin, grad), runs=3)


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("field, bad, exc, match", [
    ("x", lambda a: a["x"].double(), TypeError, "x must have dtype"),
    ("x", lambda a: a["x"][0], ValueError, "x must be 4-D"),
    ("x", lambda a: a["x"].transpose(1, 2).contiguous().transpose(1, 2), ValueError, "x must be contiguous"),
    ("weight", lambda a: a["weight"].float(), TypeError, "weight must have dtype"),
    ("weight", lambda a: a["weight"][:-1], ValueError, "weight must have shape"),
    ("cos", lambda a: a["cos"].bfloat16(), TypeError, "cos must have dtype"),
    ("cos", lambda a: a["cos"][:-1], ValueError, "cos must have shape"),
    ("sin", lambda a: a["sin"][:, :-2], ValueError, "sin must have shape"),
    ("cos", lambda a: torch.ones(7, 48)[:, :24], ValueError, "cos must be contiguous"),
    ("eps", lambda a: 0.0, ValueError, "eps"),
    ("eps", lambda a: float("nan"), ValueError, "eps"),
    ("weight", lambda a: a["weight"].to("meta"), ValueError, "weight must be on cpu"),
])
def test_bad_inputs(backend, field, bad, exc, match):
    x, w, cos, sin = _inputs(2, 7, 3, 40, 24)
    args = dict(x=x, weight=w, cos=cos, sin=sin, eps=EPS)
    args[field] = bad(args)
    before = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor) and v.device.type != "meta"}
    with flowlock.use_backend(backend), pytest.raises(exc, match=match):
        qk_norm_rope(**args)
    for k, v in before.items():
        assert_bitwise_equal(args[k], v, k)


@pytest.mark.parametrize("r", [0, 23, 42])
def test_bad_rotary_width(r):
    x, w, _, _ = _inputs(2, 7, 3, 40, 24)
    table = torch.zeros(7, r)
    with pytest.raises(ValueError, match="rotary width"):
        qk_norm_rope(x, w, table, table, EPS)
