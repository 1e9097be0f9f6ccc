"""rms_norm and rms_norm_modulate: eager parity, FP64 budgets, batch invariance, repeatability, bad inputs."""

import pytest
import torch
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3AdaLayerNormOut
from hypothesis import given, settings
from hypothesis import strategies as st
from test_rms_norm_values import MODES, adversarial

import flowlock
from flowlock.ops.rms_norm import rms_norm, rms_norm_modulate
from flowlock.ops.rms_norm.reference import rms_norm_golden, rms_norm_modulate_golden
from flowlock.testing import (
    assert_batch_invariant,
    assert_bitwise_equal,
    assert_raise_before_launch,
    assert_repeatable,
    assert_within_budget,
    batch_invariance_failures,
)

EPS = 1e-5


def _triton(fn, *args, **kwargs):
    with flowlock.use_backend("triton"):
        return fn(*args, **kwargs)


def _eager_modulate(n, shift, scale, index):
    """Diffusers' expression, on tables cast to n.dtype (exact for adaln_table's fp32 output)."""
    dt = n.dtype
    return n * (1.0 + scale.to(dt).index_select(0, index)) + shift.to(dt).index_select(0, index)


def _case(lead, s, h, r, dtype, seed=0, fp32_table=True):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*lead, s, h, generator=g) * 3).to(dtype)
    weight = (1 + 0.3 * torch.randn(h, generator=g)).to(dtype)
    # A (R, 6H) table whose column views are shift and scale, as adaln_table hands them out.
    table = (0.5 * torch.randn(r, 6 * h, generator=g)).to(dtype)
    table = table.float() if fp32_table else table
    index = torch.randint(0, r, (s,), generator=g)
    dy = torch.randn(*lead, s, h, generator=g).to(dtype)
    return x, weight, table, index, dy


def _views(table, h):
    return table[:, 3 * h:4 * h], table[:, 4 * h:5 * h]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(1, 24), (7, 40), (33, 136), (2, 7, 40)])
def test_rms_norm_forward_within_budget_of_fp64(shape, dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    weight = torch.randn(shape[-1], generator=g).to(dtype)
    out = _triton(rms_norm, x, weight, EPS)
    eager = torch.nn.RMSNorm(shape[-1], eps=EPS, dtype=dtype)
    eager.weight.data.copy_(weight)
    assert_within_budget(out, rms_norm_golden(x, weight, EPS), baseline=eager(x).detach(), what="rms_norm")


def test_rms_norm_bf16_matches_eager_rounding_points():
    """Rounding once after the weight multiply (torch 2.13) agrees with eager up to rare 1-ulp
    reduction-order differences; rounding the normalized value first (older composite) would not."""
    x, weight, _, _, _ = _case((), 70, 136, 3, torch.bfloat16)
    out = _triton(rms_norm, x, weight, EPS)
    eager = torch.nn.functional.rms_norm(x, (136,), weight, EPS)
    assert (out != eager).float().mean() < 0.01
    xf = x.float()
    rounded_first = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype) * weight
    assert (rounded_first != eager).float().mean() > 0.05


def _grads(fn, leaves, dy):
    leaves = [t.detach().clone().requires_grad_(True) for t in leaves]
    out = fn(*leaves)
    out.backward(dy.to(out.dtype))
    return out.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("lead,s,h", [((), 33, 136), ((2,), 70, 24), ((), 1, 40)])
def test_rms_norm_gradients_within_budget(lead, s, h, dtype):
    x, weight, _, _, dy = _case(lead, s, h, 3, dtype)
    _, ours = _grads(lambda a, b: _triton(rms_norm, a, b, EPS), [x, weight], dy)
    _, gold = _grads(lambda a, b: rms_norm_golden(a, b, EPS, dtype), [x.double(), weight.double()], dy)
    _, base = _grads(lambda a, b: torch.nn.functional.rms_norm(a, (h,), b, EPS), [x, weight], dy)
    for name, o, gd, b in zip(("dx", "dweight"), ours, gold, base):
        assert o.dtype == dtype
        assert_within_budget(o, gd, baseline=b, what=name)


def test_modulate_equals_diffusers_norm_out_given_the_same_normalized_value():
    """The real diffusers module with its norm replaced by flowlock's rms_norm output."""
    torch.manual_seed(0)
    h, e, t, s = 40, 16, 3, 33
    module = MiniMaxH3AdaLayerNormOut(h, e, EPS).to(torch.bfloat16)
    module.norm = torch.nn.Identity()
    temb = torch.randn(t, e)
    x = torch.randn(2, s, h).to(torch.bfloat16)
    weight = torch.randn(h).to(torch.bfloat16)
    index = torch.randint(0, t, (s,))
    with torch.no_grad():
        n = _triton(rms_norm, x, weight, EPS)
        expected = module(n, temb, index)
        table = module.linear(torch.nn.functional.silu(temb).to(torch.bfloat16)).float()
        ours = _triton(rms_norm_modulate, x, weight, table[:, :h], table[:, h:], index, EPS)
    assert_bitwise_equal(ours, expected, "rms_norm_modulate vs norm_out")


@settings(max_examples=25, deadline=None)
@given(dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]), w_mode=st.sampled_from(MODES),
       t_mode=st.sampled_from(MODES), s=st.sampled_from([1, 7, 33]), h=st.sampled_from([24, 40]),
       fp32_table=st.booleans(), seed=st.integers(0, 2**16))
def test_modulation_bitwise_equal_to_eager(dtype, w_mode, t_mode, s, h, fp32_table, seed):
    gen = torch.Generator().manual_seed(seed)
    x = adversarial((2, s, h), dtype, "normal", gen)
    weight = adversarial((h,), dtype, w_mode, gen)
    table = adversarial((3, 6 * h), dtype, t_mode, gen)
    table = table.float() if fp32_table else table
    index = torch.randint(0, 3, (s,), generator=gen)
    shift, scale = _views(table, h)
    n = _triton(rms_norm, x, weight, EPS)
    ours = _triton(rms_norm_modulate, x, weight, shift, scale, index, EPS)
    assert_bitwise_equal(ours, _eager_modulate(n, shift, scale, index))
    # The reference backend makes the same promise.
    assert_bitwise_equal(rms_norm_modulate(x, weight, shift, scale, index, EPS),
                         _eager_modulate(rms_norm(x, weight, EPS), shift, scale, index))


@pytest.mark.parametrize("dtype,fp32_table", [(torch.bfloat16, True), (torch.bfloat16, False), (torch.float32, True)])
@pytest.mark.parametrize("lead,s,h,r", [((2,), 33, 40, 9), ((), 70, 136, 3), ((3,), 1, 24, 3)])
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_modulate_gradients_within_budget(backend, lead, s, h, r, dtype, fp32_table):
    x, weight, table, index, dy = _case(lead, s, h, r, dtype, fp32_table=fp32_table)

    def ours(a, w, tb):
        with flowlock.use_backend(backend):
            return rms_norm_modulate(a, w, *_views(tb, h), index, EPS)

    def golden(a, w, tb):
        return rms_norm_modulate_golden(a, w, *_views(tb, h), index, EPS, dtype)

    def eager(a, w, tb):
        n = torch.nn.functional.rms_norm(a, (h,), w, EPS)
        return _eager_modulate(n, *_views(tb.to(dtype), h), index)

    _, got = _grads(ours, [x, weight, table], dy)
    _, gold = _grads(golden, [x.double(), weight.double(), table.double()], dy)
    _, base = _grads(eager, [x, weight, table], dy)
    assert got[2].dtype == table.dtype
    for name, o, gd, b in zip(("dx", "dweight", "dtable"), got, gold, base):
        assert_within_budget(o, gd, baseline=b, out_dtype=dtype if name != "dtable" else table.dtype, what=name)
    # Columns of the table that no op reads get exact zeros.
    assert torch.equal(got[2][:, :3 * h], torch.zeros_like(got[2][:, :3 * h]))


def _per_sample(weight, table, index, h):
    """Forward output and dx of a batch (per-sample quantities only)."""
    def run(xb, dyb):
        _, (dx,) = _grads(lambda a: _triton(rms_norm_modulate, a, weight, *_views(table, h), index, EPS), [xb], dyb)
        return _triton(rms_norm_modulate, xb, weight, *_views(table, h), index, EPS), dx
    return run


def test_batch_invariant_forward_and_dx():
    x, weight, table, index, dy = _case((8,), 7, 40, 3, torch.bfloat16)
    assert_batch_invariant(_per_sample(weight, table, index, 40), (x, dy), sizes=(2, 3, 8))


def _planted_rms_norm(x, weight):
    """Non-invariant on purpose: the mean-square sum is split at a batch-size-dependent column."""
    xf = x.float()
    k = 8 * x.shape[0] % x.shape[-1]
    ms = (xf[..., :k].pow(2).sum(-1, keepdim=True) + xf[..., k:].pow(2).sum(-1, keepdim=True)) / x.shape[-1]
    return (xf * torch.rsqrt(ms + EPS) * weight.float()).to(x.dtype)


def test_batch_invariance_harness_catches_planted_split():
    x, weight, _, _, _ = _case((8,), 7, 136, 3, torch.float32, seed=5)
    assert batch_invariance_failures(lambda xb: _planted_rms_norm(xb, weight), x, sizes=(2, 3, 8))


def test_gradients_repeatable_over_runs():
    x, weight, table, index, dy = _case((2,), 70, 40, 9, torch.bfloat16)

    def run():
        out, grads = _grads(lambda a, w, tb: _triton(rms_norm_modulate, a, w, *_views(tb, 40), index, EPS),
                            [x, weight, table], dy)
        _, plain = _grads(lambda a, w: _triton(rms_norm, a, w, EPS), [x, weight], dy)
        return (out, *grads, *plain)

    assert_repeatable(run, runs=20)


def _bad_calls():
    x, weight, table, index, _ = _case((2,), 7, 24, 3, torch.bfloat16)
    shift, scale = _views(table, 24)
    m = rms_norm_modulate
    return [
        (TypeError, "x", lambda: rms_norm(x.int(), weight, EPS)),
        (ValueError, "x", lambda: rms_norm(x.transpose(0, 1), weight, EPS)),
        (TypeError, "weight", lambda: rms_norm(x, weight.float(), EPS)),
        (ValueError, "weight", lambda: rms_norm(x, weight[:23], EPS)),
        (ValueError, "weight", lambda: rms_norm(x, weight.to("meta"), EPS)),
        (ValueError, "eps", lambda: rms_norm(x, weight, -1.0)),
        (TypeError, "eps", lambda: rms_norm(x, weight, None)),
        (ValueError, "x", lambda: m(x[0, 0], weight, shift, scale, index, EPS)),
        (TypeError, "shift", lambda: m(x, weight, shift.half(), scale, index, EPS)),
        (TypeError, "scale", lambda: m(x, weight, shift, scale.to(torch.bfloat16), index, EPS)),
        (ValueError, "shift", lambda: m(x, weight, shift[:, :23], scale, index, EPS)),
        (ValueError, "scale", lambda: m(x, weight, shift, scale[:2], index, EPS)),
        (ValueError, "scale", lambda: m(x, weight, shift, table[:, ::6][:, :24], index, EPS)),
        (ValueError, "shift", lambda: m(x, weight, shift.to("meta"), scale, index, EPS)),
        (TypeError, "index", lambda: m(x, weight, shift, scale, index.float(), EPS)),
        (ValueError, "index", lambda: m(x, weight, shift, scale, index[:6], EPS)),
        (ValueError, "index", lambda: m(x, weight, shift, scale, torch.full((7,), 3), EPS)),
        (ValueError, "index", lambda: m(x, weight, shift, scale, torch.full((7,), -1), EPS)),
        (ValueError, "index", lambda: m(x, weight, shift, scale, index.to("meta"), EPS)),
    ], (x, weight, table, index)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_bad_inputs_raise_before_launch_and_leave_inputs_unchanged(backend):
    calls, inputs = _bad_calls()
    with flowlock.use_backend(backend):
        assert_raise_before_launch(calls, inputs)


def test_compiled_equals_eager():
    """torch.compile sees forward and backward as opaque custom ops: same bits as eager."""
    x, weight, table, index, dy = _case((2,), 33, 40, 9, torch.bfloat16)

    def fn(a, w, tb):
        n = _triton(rms_norm, a, w, EPS)
        return n + _triton(rms_norm_modulate, a, w, *_views(tb, 40), index, EPS, check_indices=False)

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    assert_bitwise_equal(_grads(compiled, [x, weight, table], dy)[1], _grads(fn, [x, weight, table], dy)[1])
