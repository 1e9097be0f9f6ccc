"""final_adaln_out in fp32 and fp16 (bf16: test_final_adaln.py): FP64-golden budgets on both backends
against diffusers' eager norm_out, rows pure."""

import pytest
import torch
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3AdaLayerNormOut

import flowlock
from flowlock.ops.final_adaln import final_adaln_out
from flowlock.ops.final_adaln.reference import final_adaln_out_golden
from flowlock.testing import assert_batch_invariant, assert_within_budget

EPS = 1e-6
DTYPES = (torch.float32, torch.float16)
NAMES = ("dx", "d_temb", "d_norm_weight", "dW", "db")


def _inputs(b, s, t, e, h, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(b, s, h, generator=g) * 3).to(dtype)
    temb = torch.randn(t, e, generator=g) * 2
    norm_weight = (torch.rand(h, generator=g) + 0.5).to(dtype)
    weight = (torch.randn(2 * h, e, generator=g) * 0.2).to(dtype)
    bias = (torch.randn(2 * h, generator=g) * 0.2).to(dtype)
    return x, temb, norm_weight, weight, bias, torch.randint(0, t, (s,), generator=g)


def _eager(x, temb, nw, w, b, ti):
    module = MiniMaxH3AdaLayerNormOut(x.shape[-1], temb.shape[1], EPS).to(x.dtype)
    return torch.func.functional_call(module, {"norm.weight": nw, "linear.weight": w, "linear.bias": b},
                                      (x, temb, ti))


def _backend(name):
    def fn(x, temb, nw, w, b, ti):
        with flowlock.use_backend(name):
            return final_adaln_out(x, temb, nw, w, b, ti, EPS)
    return fn


def _grads(fn, args, upstream, double=False):
    leaves = [(a.detach().double() if double else a.detach().clone()).requires_grad_() for a in args[:5]]
    y = fn(*leaves, args[5])
    (y.double() * upstream.double()).sum().backward()
    return y.detach(), [a.grad for a in leaves]


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_and_gradients_within_budget(dtype, backend):
    args = _inputs(2, 33, 2, 36, 40, dtype, seed=5)
    upstream = torch.randn(2, 33, 40, generator=torch.Generator().manual_seed(3)).to(dtype)
    y, grads = _grads(_backend(backend), args, upstream)
    y_eager, eager = _grads(_eager, args, upstream)
    y_gold, golden = _grads(lambda *a: final_adaln_out_golden(*a, EPS, dtype), args, upstream, double=True)
    assert y.dtype == dtype
    assert_within_budget(y, y_gold, baseline=y_eager, what=f"y {dtype}")
    for name, mine, base, gold in zip(NAMES, grads, eager, golden):
        assert mine.dtype == base.dtype, name
        assert_within_budget(mine, gold, baseline=base, what=f"{name} {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_invariant(dtype):
    x, temb, nw, w, b, ti = _inputs(7, 9, 2, 20, 24, dtype, seed=6)
    assert_batch_invariant(lambda xs: _backend("triton")(xs, temb, nw, w, b, ti), x, sizes=(2, 7))
