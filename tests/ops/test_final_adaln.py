"""final_adaln_out: diffusers norm_out parity given the table, FP64 budgets against eager diffusers,
the one-node FP32 table gradient, bad inputs refused before launch (invariance and repeatability
live in test_final_adaln_invariance.py)."""

import pytest
import torch
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3AdaLayerNormOut
from final_adaln_cases import final_adaln_inputs
from hypothesis import given, settings
from hypothesis import strategies as st

import flowlock
import flowlock.ops.adaln.triton as adaln_triton
import flowlock.ops.final_adaln.triton as final_triton
from flowlock.ops.adaln.triton import AdalnTableFunction
from flowlock.ops.final_adaln import final_adaln_out
from flowlock.ops.final_adaln.reference import final_adaln_out_golden
from flowlock.ops.rms_norm import rms_norm_modulate
from flowlock.testing import (
    assert_bitwise_equal,
    assert_within_budget,
    max_abs_error,
)

EPS = 1e-6




def _module(h, e):
    return MiniMaxH3AdaLayerNormOut(h, e, EPS).to(torch.bfloat16)


class _FixedProjection(torch.nn.Module):
    """Stands in for ``norm_out.linear``: returns a given ``(T, 2H)`` table, stored in BF16."""

    def __init__(self, table):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, dtype=torch.bfloat16))
        self.table = table.to(torch.bfloat16)

    def forward(self, act):
        return self.table


def _table(temb, weight, bias):
    with flowlock.use_backend("triton"):
        return AdalnTableFunction.apply(temb, weight, bias)


def _triton(x, temb, nw, w, b, ti):
    with flowlock.use_backend("triton"):
        return final_adaln_out(x, temb, nw, w, b, ti, EPS)


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("b,s,t,e,h", [(1, 1, 1, 20, 24), (2, 7, 2, 36, 40), (1, 33, 3, 20, 24)])
def test_bitwise_equals_diffusers_norm_out_given_the_same_table(backend, b, s, t, e, h):
    x, temb, nw, w, bias, ti = final_adaln_inputs(b, s, t, e, h, seed=s)
    with flowlock.use_backend(backend):
        y = final_adaln_out(x, temb, nw, w, bias, ti, EPS)
    module = _module(h, e)
    module.norm.weight.data.copy_(nw)
    module.linear = _FixedProjection(_table(temb, w, bias))
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert_bitwise_equal(y, module(x, temb, ti), "final_adaln_out")


@settings(max_examples=6, deadline=None)
@given(b=st.integers(1, 3), s=st.integers(1, 40), t=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_hypothesis_equals_diffusers_given_table(b, s, t, seed):
    x, temb, nw, w, bias, ti = final_adaln_inputs(b, s, t, 20, 24, seed=seed)
    module = _module(24, 20)
    module.norm.weight.data.copy_(nw)
    module.linear = _FixedProjection(_table(temb, w, bias))
    assert_bitwise_equal(_triton(x, temb, nw, w, bias, ti), module(x, temb, ti))


def _grads(fn, args, upstream, double=False):
    leaves = [a.detach().double() if double else a.detach().clone() for a in args[:5]]
    leaves = [a.requires_grad_(True) for a in leaves]
    y = fn(*leaves, args[5])
    (y.double() * upstream.double()).sum().backward()
    return y, [a.grad for a in leaves]


def _eager(x, temb, nw, w, b, ti):
    module = _module(x.shape[-1], temb.shape[1])
    params = {"norm.weight": nw, "linear.weight": w, "linear.bias": b}
    return torch.func.functional_call(module, params, (x, temb, ti))


def _golden(x, temb, nw, w, b, ti):
    return final_adaln_out_golden(x, temb, nw, w, b, ti, EPS)


NAMES = ("dx", "d_temb", "d_norm_weight", "dW", "db")


def _reference(x, temb, nw, w, b, ti):
    with flowlock.use_backend("reference"):
        return final_adaln_out(x, temb, nw, w, b, ti, EPS)


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("b,s,t,e,h", [(1, 1, 1, 20, 24), (2, 33, 2, 36, 40), (3, 33, 3, 20, 24)])
def test_forward_and_gradients_within_budget_and_no_worse_than_diffusers(backend, b, s, t, e, h):
    args = final_adaln_inputs(b, s, t, e, h, seed=b + s)
    upstream = torch.randn(b, s, h, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    y, grads = _grads(_triton if backend == "triton" else _reference, args, upstream)
    y_eager, eager = _grads(_eager, args, upstream)
    y_gold, golden = _grads(_golden, args, upstream, double=True)
    assert_within_budget(y, y_gold, baseline=y_eager, what="y")
    for name, mine, base, gold in zip(NAMES, grads, eager, golden):
        assert mine.dtype == base.dtype, name
        assert_within_budget(mine, gold, baseline=base, what=name)
        assert max_abs_error(mine, gold) <= max_abs_error(base, gold), name


def test_unbatched_x_equals_a_batch_of_one():
    x, temb, nw, w, b, ti = final_adaln_inputs(1, 7, 2, 20, 24, seed=9)
    assert_bitwise_equal(_triton(x[0], temb, nw, w, b, ti), _triton(x, temb, nw, w, b, ti)[0])


def _two_node(x, temb, nw, w, b, ti):
    """Projection and modulation as separate nodes over a BF16 table: the shift/scale gradients
    are rounded to BF16 between them (what the one-node op avoids)."""
    table = AdalnTableFunction.apply(temb, w, b).to(torch.bfloat16)
    h = x.shape[-1]
    return rms_norm_modulate(x, nw, table[:, :h], table[:, h:], ti, EPS)


def test_one_node_table_gradient_stays_fp32():
    args = final_adaln_inputs(3, 33, 2, 20, 24, seed=8)
    upstream = torch.randn(3, 33, 24, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    _, grads = _grads(_triton, args, upstream)
    with flowlock.use_backend("triton"):
        _, two = _grads(_two_node, args, upstream)
    _, golden = _grads(_golden, args, upstream, double=True)
    assert max_abs_error(grads[1], golden[1]) < max_abs_error(two[1], golden[1]), "d_temb"
    for k in (3, 4):
        assert max_abs_error(grads[k], golden[k]) <= max_abs_error(two[k], golden[k]), NAMES[k]


def test_compiled_equals_eager():
    """torch.compile sees the node as opaque custom ops: same output and gradients as eager."""
    args = final_adaln_inputs(2, 7, 2, 20, 24, seed=13)
    upstream = torch.randn(2, 7, 24, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)

    def fn(x, temb, nw, w, b, ti):
        with flowlock.use_backend("triton"):
            return final_adaln_out(x * 1, temb, nw, w, b, ti, EPS, check_indices=False)
    eager = _grads(fn, args, upstream)
    torch._dynamo.reset()
    compiled = _grads(torch.compile(fn, backend="aot_eager", fullgraph=True), args, upstream)
    assert_bitwise_equal((compiled[0], *compiled[1]), (eager[0], *eager[1]), "compiled vs eager")


def _bad_cases():
    x, temb, nw, w, b, ti = final_adaln_inputs(2, 7, 2, 20, 24)
    meta = torch.device("meta")
    return [
        ("index == T", (x, temb, nw, w, b, torch.full((7,), 2)), ValueError),
        ("negative index", (x, temb, nw, w, b, torch.full((7,), -1)), ValueError),
        ("index length", (x, temb, nw, w, b, ti[:6]), ValueError),
        ("float index", (x, temb, nw, w, b, ti.float()), TypeError),
        ("fp32 x", (x.float(), temb, nw, w, b, ti), TypeError),
        ("bf16 temb", (x, temb.to(torch.bfloat16), nw, w, b, ti), TypeError),
        ("fp32 norm_weight", (x, temb, nw.float(), w, b, ti), TypeError),
        ("fp32 weight", (x, temb, nw, w.float(), b, ti), TypeError),
        ("weight rows 18H not 2H", (x, temb, nw, w.repeat(9, 1), b.repeat(9), ti), ValueError),
        ("odd weight rows", (x, temb, nw, w[:-1].contiguous(), b[:-1].contiguous(), ti), ValueError),
        ("E mismatch", (x, temb[:, :19].contiguous(), nw, w, b, ti), ValueError),
        ("norm_weight length", (x, temb, nw[:-1].contiguous(), w, b, ti), ValueError),
        ("x 1-D", (x[0, 0], temb, nw, w, b, ti), ValueError),
        ("non-contiguous x", (x.transpose(0, 1).contiguous().transpose(0, 1), temb, nw, w, b, ti), ValueError),
        ("index device", (x, temb, nw, w, b, ti.to(meta)), ValueError),
        ("temb device", (x, temb.to(meta), nw, w, b, ti), ValueError),
    ]


@pytest.mark.parametrize("case", range(len(_bad_cases())))
def test_bad_inputs_raise_before_any_launch(case, monkeypatch):
    name, args, error = _bad_cases()[case]
    launched = []
    monkeypatch.setattr(adaln_triton, "adaln_table_fwd", lambda *a: launched.append("adaln_table_fwd"))
    monkeypatch.setattr(final_triton, "rms_norm_fwd", lambda *a: launched.append("rms_norm_fwd"))
    before = [a.clone() for a in args]
    with flowlock.use_backend("triton"), pytest.raises(error):
        final_adaln_out(*args, EPS)
    assert not launched, name
    for a, b in zip(args, before):
        if a.device.type != "meta":
            assert_bitwise_equal(a, b, name)


@pytest.mark.parametrize("eps", [-1.0, float("nan"), float("inf")])
def test_bad_eps_raises(eps):
    x, temb, nw, w, b, ti = final_adaln_inputs(1, 7, 2, 20, 24)
    with pytest.raises(ValueError, match="eps"):
        final_adaln_out(x, temb, nw, w, b, ti, eps)
