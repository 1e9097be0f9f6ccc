"""adaln_table_kept: adaln_table's node with its values given. Same values and gradient bits as
adaln_table, no projection launch, bad input refused before anything runs."""

import pytest
import torch
from adaln_cases import adaln_params

import flowlock
import flowlock.ops.adaln.triton as adaln_triton
from flowlock.ops.adaln import adaln_table, adaln_table_kept
from flowlock.testing import assert_bitwise_equal


def _step(table_fn, temb, weight, bias, upstream):
    leaves = [x.clone().requires_grad_() for x in (temb, weight, bias)]
    table = table_fn(*leaves)
    (table.double() * upstream).sum().backward()
    return table.detach(), [leaf.grad for leaf in leaves]


def _upstream(t, h, seed):
    return torch.randn(3 * t, 6 * h, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 5


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("t,e,h", [(1, 20, 24), (3, 36, 40)])
def test_values_and_gradients_are_adaln_tables(backend, t, e, h):
    temb, weight, bias = adaln_params(t, e, h, seed=t)
    upstream = _upstream(t, h, seed=t)
    with flowlock.use_backend(backend):
        table, grads = _step(adaln_table, temb, weight, bias, upstream)
        kept, kept_grads = _step(lambda *leaves: adaln_table_kept(table.clone(), *leaves), temb, weight, bias, upstream)
    assert_bitwise_equal(kept, table, "table")
    assert_bitwise_equal(kept_grads, grads, "d_temb, dW, db")


def test_the_node_launches_no_projection_and_returns_a_view_of_the_given_table(monkeypatch):
    temb, weight, bias = adaln_params(2, 20, 24, seed=5)
    upstream = _upstream(2, 24, seed=5)
    with flowlock.use_backend("triton"):
        table, grads = _step(adaln_table, temb, weight, bias, upstream)
        given = table.clone()
        monkeypatch.setattr(adaln_triton, "adaln_table_fwd", lambda *a: pytest.fail("projection launched"))
        leaves = [x.clone().requires_grad_() for x in (temb, weight, bias)]
        kept = adaln_table_kept(given, *leaves)
        assert kept.data_ptr() == given.data_ptr() and kept.grad_fn is not None
        (kept.double() * upstream).sum().backward()
        assert_bitwise_equal([leaf.grad for leaf in leaves], grads, "gradients")
        # Without a gradient to record, the given table is the answer.
        assert adaln_table_kept(given, temb, weight, bias) is given


def test_only_the_needed_gradients_are_computed():
    temb, weight, bias = adaln_params(2, 20, 24, seed=8)
    upstream = _upstream(2, 24, seed=8)
    with flowlock.use_backend("triton"):
        table, grads = _step(adaln_table, temb, weight, bias, upstream)
        leaves = [temb.clone(), weight.clone().requires_grad_(), bias.clone().requires_grad_()]
        (adaln_table_kept(table, *leaves).double() * upstream).sum().backward()
    assert leaves[0].grad is None
    assert_bitwise_equal([leaves[1].grad, leaves[2].grad], grads[1:], "dW, db")


def _bad_tables():
    temb, weight, bias = adaln_params(2, 20, 24)
    good = torch.zeros(6, 6 * 24)
    return [
        ("rows", (good[:5], temb, weight, bias), ValueError),
        ("columns", (torch.zeros(6, 6 * 24 + 1), temb, weight, bias), ValueError),
        ("bf16 table", (good.to(torch.bfloat16), temb, weight, bias), TypeError),
        ("non-contiguous table", (torch.zeros(6 * 24, 6).t(), temb, weight, bias), ValueError),
        ("table device", (good.to("meta"), temb, weight, bias), ValueError),
        ("bf16 temb", (good, temb.to(torch.bfloat16), weight, bias), TypeError),
        ("weight rows not 18H", (good, temb, weight[:-1].contiguous(), bias[:-1].contiguous()), ValueError),
    ]


@pytest.mark.parametrize("case", range(len(_bad_tables())))
def test_bad_inputs_raise_before_anything_runs(case, monkeypatch):
    name, args, error = _bad_tables()[case]
    ran = []
    monkeypatch.setattr(adaln_triton, "adaln_table_fwd", lambda *a: ran.append("projection"))
    monkeypatch.setattr(adaln_triton, "silu_act", lambda *a: ran.append("silu"))
    with flowlock.use_backend("triton"), pytest.raises(error):
        adaln_table_kept(*args)
    assert not ran, name
