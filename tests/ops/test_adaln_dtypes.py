"""adaln_table / adaln_modulation with fp32 and fp16 projections (bf16: test_adaln.py): FP64-golden
budgets on both backends against diffusers' eager module, the table holding values of the weight's
dtype, rows pure."""

import pytest
import torch
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3AdaLayerNormModulation

import flowlock
import flowlock.ops.adaln.triton as adaln_triton
from flowlock.ops.adaln import adaln_modulation, adaln_table
from flowlock.ops.adaln.reference import adaln_modulation_golden
from flowlock.testing import assert_batch_invariant, assert_within_budget

DTYPES = (torch.float32, torch.float16)


def _params(t, e, h, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    temb = torch.randn(t, e, generator=g) * 2
    weight = (torch.randn(18 * h, e, generator=g) * 0.2).to(dtype)
    bias = (torch.randn(18 * h, generator=g) * 0.2).to(dtype)
    ti, tag = torch.randint(0, t, (9,), generator=g), torch.randint(0, 3, (9,), generator=g)
    return temb, weight, bias, ti, tag


def _eager(temb, weight, bias, ti, tag):
    module = MiniMaxH3AdaLayerNormModulation(weight.shape[1], weight.shape[0] // 18).to(weight.dtype)
    chunks = torch.func.functional_call(module, {"linear.weight": weight, "linear.bias": bias}, (temb,))
    return tuple(c.index_select(0, ti * 3 + tag) for c in chunks)


def _backend(name):
    def fn(*args):
        with flowlock.use_backend(name):
            return adaln_modulation(*args)
    return fn


def _grads(fn, temb, weight, bias, ti, tag, upstream):
    leaves = [x.detach().clone().requires_grad_(True) for x in (temb, weight, bias)]
    outs = fn(*leaves, ti, tag)
    sum((o.double() * u.double()).sum() for o, u in zip(outs, upstream)).backward()
    return [o.detach() for o in outs], [x.grad for x in leaves]


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_and_gradients_within_budget(dtype, backend):
    temb, weight, bias, ti, tag = _params(2, 36, 40, dtype, seed=1)
    upstream = [torch.randn(9, 40, generator=torch.Generator().manual_seed(k)).to(dtype) for k in range(6)]
    outs, grads = _grads(_backend(backend), temb, weight, bias, ti, tag, upstream)
    eager_outs, eager_grads = _grads(_eager, temb, weight, bias, ti, tag, upstream)
    gold_outs, gold_grads = _grads(lambda *a: adaln_modulation_golden(*a, dtype), temb.double(), weight.double(),
                                   bias.double(), ti, tag, upstream)
    for k, (o, e, g) in enumerate(zip(outs, eager_outs, gold_outs)):
        assert o.dtype == dtype
        assert_within_budget(o, g, baseline=e, what=f"output {k} {dtype}")
    for name, mine, eager, gold in zip(("d_temb", "dW", "db"), grads, eager_grads, gold_grads):
        assert mine.dtype == eager.dtype, name
        assert_within_budget(mine, gold, baseline=eager, what=f"{name} {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_table_holds_weight_dtype_values_and_rows_are_pure(dtype):
    temb, weight, bias, _, _ = _params(7, 20, 24, dtype, seed=2)
    with flowlock.use_backend("triton"):
        table = adaln_table(temb, weight, bias)
    assert table.dtype == torch.float32 and torch.equal(table, table.to(dtype).float())

    # The kernel's rows, given the activation: CPU torch's vectorized SiLU is not itself position-pure
    # (its tail loop rounds differently), a property of the host library, not of the kernel.
    act = torch.nn.functional.silu(temb)
    assert_batch_invariant(lambda a: adaln_triton.adaln_table_fwd(a, weight, bias), act, sizes=(2, 7))
