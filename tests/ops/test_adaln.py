"""adaln_table / adaln_modulation: diffusers parity given the table, FP64 budgets, one-node FP32
table gradient, row purity, repeatability, and bad inputs refused before any launch."""

import pytest
import torch
from adaln_cases import adaln_params
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3AdaLayerNormModulation
from hypothesis import given, settings
from hypothesis import strategies as st

import flowlock
import flowlock.ops.adaln.triton as adaln_triton
from flowlock.ops.adaln import adaln_modulation, adaln_table
from flowlock.ops.adaln.reference import adaln_modulation_golden, adaln_table_golden
from flowlock.testing import (
    assert_batch_invariant,
    assert_bitwise_equal,
    assert_repeatable,
    assert_within_budget,
    batch_invariance_failures,
    max_abs_error,
    repeat_failures,
)


def _indices(s, t, seed=0):
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randint(0, t, (s,), generator=g), torch.randint(0, 3, (s,), generator=g)


def _diffusers_module(weight, bias):
    h = weight.shape[0] // 18
    module = MiniMaxH3AdaLayerNormModulation(weight.shape[1], h).to(torch.bfloat16)
    module.linear.weight.data.copy_(weight)
    module.linear.bias.data.copy_(bias)
    return module


class _FixedProjection(torch.nn.Module):
    """Stands in for diffusers' ``adaln_proj.linear``: returns a given table, stored in BF16."""

    def __init__(self, table, t):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, dtype=torch.bfloat16))
        self.table = table.to(torch.bfloat16).view(t, -1)

    def forward(self, act):
        return self.table


def _diffusers_given_table(table, temb, ti, tag):
    """diffusers' own forward (view, chunk, index_select) with its projection output set to ``table``."""
    t = temb.shape[0]
    module = MiniMaxH3AdaLayerNormModulation(temb.shape[1], table.shape[1] // 6)
    module.linear = _FixedProjection(table, t)
    adaln_indices = ti * 3 + tag
    return tuple(c.index_select(0, adaln_indices) for c in module(temb))


def _triton_modulation(*args):
    with flowlock.use_backend("triton"):
        return adaln_modulation(*args)


def _triton_table(*args):
    with flowlock.use_backend("triton"):
        return adaln_table(*args)


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("t,e,h,s", [(1, 20, 24, 1), (2, 36, 40, 7), (3, 20, 24, 33)])
def test_modulation_bitwise_equals_diffusers_given_the_same_table(backend, t, e, h, s):
    temb, weight, bias = adaln_params(t, e, h, seed=s)
    ti, tag = _indices(s, t, seed=s)
    with flowlock.use_backend(backend):
        table = adaln_table(temb, weight, bias)
        outs = adaln_modulation(temb, weight, bias, ti, tag)
    assert table.dtype == torch.float32 and table.shape == (3 * t, 6 * h)
    assert torch.equal(table, table.to(torch.bfloat16).float()), "table must hold BF16 values"
    assert all(o.dtype == torch.bfloat16 and o.shape == (s, h) and o.is_contiguous() for o in outs)
    assert_bitwise_equal(outs, _diffusers_given_table(table, temb, ti, tag), "adaln_modulation")


@settings(max_examples=12, deadline=None)
@given(t=st.integers(1, 3), s=st.integers(1, 40), seed=st.integers(0, 2**16),
       idx32=st.booleans())
def test_hypothesis_modulation_equals_diffusers_given_table(t, s, seed, idx32):
    temb, weight, bias = adaln_params(t, 20, 24, seed=seed)
    ti, tag = _indices(s, t, seed=seed)
    if idx32:
        ti, tag = ti.int(), tag.int()
    table = _triton_table(temb, weight, bias)
    outs = _triton_modulation(temb, weight, bias, ti, tag)
    assert_bitwise_equal(outs, _diffusers_given_table(table, temb, ti.long(), tag.long()))


def _grads(fn, temb, weight, bias, ti, tag, upstream):
    leaves = [x.detach().clone().requires_grad_(True) for x in (temb, weight, bias)]
    outs = fn(*leaves, ti, tag)
    loss = sum((o.double() * u.double()).sum() for o, u in zip(outs, upstream))
    loss.backward()
    return outs, [x.grad for x in leaves]


def _diffusers_eager(temb, weight, bias, ti, tag):
    module = _diffusers_module(weight.detach(), bias.detach())
    chunks = torch.func.functional_call(module, {"linear.weight": weight, "linear.bias": bias}, (temb,))
    return tuple(c.index_select(0, ti * 3 + tag) for c in chunks)


def _upstream(s, h, seed):
    g = torch.Generator().manual_seed(seed + 7)
    return [torch.randn(s, h, generator=g).to(torch.bfloat16) for _ in range(6)]


def _reference_modulation(*args):
    with flowlock.use_backend("reference"):
        return adaln_modulation(*args)


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("t,e,h,s", [(1, 20, 24, 7), (2, 36, 40, 33), (3, 20, 24, 33)])
def test_forward_and_gradients_within_budget_of_fp64_golden(backend, t, e, h, s):
    temb, weight, bias = adaln_params(t, e, h, seed=t)
    ti, tag = _indices(s, t, seed=t)
    upstream = _upstream(s, h, seed=t)
    fn = _triton_modulation if backend == "triton" else _reference_modulation
    outs, grads = _grads(fn, temb, weight, bias, ti, tag, upstream)
    eager_outs, eager_grads = _grads(_diffusers_eager, temb, weight, bias, ti, tag, upstream)
    golden_outs, golden_grads = _grads(adaln_modulation_golden, temb.double(), weight.double(), bias.double(),
                                       ti, tag, upstream)
    for k, (o, e_o, g_o) in enumerate(zip(outs, eager_outs, golden_outs)):
        assert_within_budget(o, g_o, baseline=e_o, what=f"output {k}")
    for name, mine, eager, golden in zip(("d_temb", "dW", "db"), grads, eager_grads, golden_grads):
        assert mine.dtype == eager.dtype
        assert_within_budget(mine, golden, baseline=eager, what=name)
        # At least as accurate as the provider's eager path.
        assert max_abs_error(mine, golden) <= max_abs_error(eager, golden), name


def _two_node_modulation(temb, weight, bias, ti, tag):
    """The projection and an index_select on a BF16 table as separate nodes: the table gradient is
    accumulated and stored in BF16 between them (what one node avoids)."""
    table = adaln_table(temb, weight, bias).to(torch.bfloat16)
    return tuple(c.index_select(0, ti * 3 + tag) for c in table.chunk(6, dim=-1))


def test_one_node_table_gradient_stays_fp32():
    t, e, h, s = 2, 20, 24, 33
    temb, weight, bias = adaln_params(t, e, h, seed=3)
    ti, tag = _indices(s, t, seed=3)
    upstream = _upstream(s, h, seed=3)
    _, grads = _grads(_triton_modulation, temb, weight, bias, ti, tag, upstream)
    with flowlock.use_backend("triton"):
        _, two_node = _grads(_two_node_modulation, temb, weight, bias, ti, tag, upstream)
    _, golden = _grads(adaln_modulation_golden, temb.double(), weight.double(), bias.double(), ti, tag, upstream)
    assert max_abs_error(grads[0], golden[0]) < max_abs_error(two_node[0], golden[0]), "d_temb"
    for k in (1, 2):
        assert max_abs_error(grads[k], golden[k]) <= max_abs_error(two_node[k], golden[k])


def test_table_gradients_within_budget():
    temb, weight, bias = adaln_params(3, 36, 40, seed=5)
    g = torch.Generator().manual_seed(11)
    upstream = torch.randn(9, 240, generator=g)
    leaves = [x.clone().requires_grad_(True) for x in (temb, weight, bias)]
    (_triton_table(*leaves) * upstream).sum().backward()
    gold = [x.double().requires_grad_(True) for x in (temb, weight, bias)]
    (adaln_table_golden(*gold) * upstream.double()).sum().backward()
    module = _diffusers_module(weight, bias)
    tb = temb.clone().requires_grad_(True)
    eager = torch.cat(module(tb), dim=-1).view(9, 240)
    (eager.float() * upstream).sum().backward()
    eager_grads = [tb.grad, module.linear.weight.grad, module.linear.bias.grad]
    for name, mine, golden, base in zip(("d_temb", "dW", "db"), [x.grad for x in leaves],
                                        [x.grad for x in gold], eager_grads):
        assert_within_budget(mine, golden, baseline=base, what=name)


def _row_table(weight, bias):
    return lambda rows: _triton_table(rows, weight, bias).view(rows.shape[0], -1)


def _planted_row_table(weight, bias):
    """Planted defect: the K reduction is split into as many BF16-rounded parts as there are rows."""
    def table(rows):
        act = torch.nn.functional.silu(rows).to(torch.bfloat16).float()
        w = weight.float()
        parts = [(a @ wk.T).to(torch.bfloat16).float()
                 for a, wk in zip(act.tensor_split(rows.shape[0], 1), w.tensor_split(rows.shape[0], 1))]
        return (sum(parts) + bias.float()).to(torch.bfloat16).float()
    return table


def test_table_rows_are_pure_and_harness_catches_planted_split():
    temb, weight, bias = adaln_params(16, 36, 24, seed=9)
    assert_batch_invariant(_row_table(weight, bias), temb)
    assert batch_invariance_failures(_planted_row_table(weight, bias), temb), "harness missed a planted split"


def test_rows_pure_across_row_tiles():
    # T = 17 spans two 16-row tiles: every row still equals that row computed alone.
    temb, weight, bias = adaln_params(17, 20, 24, seed=14)
    table = _triton_table(temb, weight, bias).view(17, -1)
    alone = torch.cat([_triton_table(temb[i:i + 1], weight, bias).view(1, -1) for i in range(17)])
    assert_bitwise_equal(table, alone, "T = 17 vs rows alone")


def test_empty_sequence():
    temb, weight, bias = adaln_params(2, 20, 24, seed=15)
    empty = torch.zeros(0, dtype=torch.long)
    leaf = temb.clone().requires_grad_(True)
    outs = _triton_modulation(leaf, weight, bias, empty, empty)
    assert all(o.shape == (0, 24) for o in outs)
    sum(o.float().sum() for o in outs).backward()
    assert torch.equal(leaf.grad, torch.zeros_like(temb))


def test_d_temb_rows_are_pure():
    temb, weight, bias = adaln_params(16, 20, 24, seed=10)
    upstream = torch.randn(16, 18 * 24, generator=torch.Generator().manual_seed(2))

    def d_temb(rows, grads):
        leaf = rows.clone().requires_grad_(True)
        (_triton_table(leaf, weight, bias).view(rows.shape[0], -1) * grads).sum().backward()
        return leaf.grad
    assert_batch_invariant(d_temb, (temb, upstream), sizes=(2, 7, 16))


def test_gradients_repeatable():
    temb, weight, bias = adaln_params(3, 20, 24, seed=4)
    ti, tag = _indices(33, 3, seed=4)
    upstream = _upstream(33, 24, seed=4)
    assert_repeatable(lambda: _grads(_triton_modulation, temb, weight, bias, ti, tag, upstream)[1], runs=20)


@pytest.mark.parametrize("trainable", ["temb", "params"])
def test_backward_skips_unneeded_gradients_without_changing_the_rest(trainable):
    temb, weight, bias = adaln_params(2, 20, 24, seed=6)
    ti, tag = _indices(7, 2, seed=6)
    upstream = _upstream(7, 24, seed=6)
    _, full = _grads(_triton_modulation, temb, weight, bias, ti, tag, upstream)
    leaves = [temb.clone().requires_grad_(trainable == "temb"), weight.clone().requires_grad_(trainable == "params"),
              bias.clone().requires_grad_(trainable == "params")]
    outs = _triton_modulation(*leaves, ti, tag)
    sum((o.double() * u.double()).sum() for o, u in zip(outs, upstream)).backward()
    for leaf, ref in zip(leaves, full):
        if leaf.requires_grad:
            assert_bitwise_equal(leaf.grad, ref)
        else:
            assert leaf.grad is None


def test_compiled_equals_eager():
    """torch.compile sees the node as opaque custom ops: same outputs and gradients as eager."""
    temb, weight, bias = adaln_params(2, 20, 24, seed=13)
    ti, tag = _indices(7, 2, seed=13)
    upstream = _upstream(7, 24, seed=13)

    def fn(temb, weight, bias, ti, tag):
        with flowlock.use_backend("triton"):
            return adaln_modulation(temb * 1, weight, bias, ti, tag, check_indices=False)
    eager = _grads(fn, temb, weight, bias, ti, tag, upstream)
    torch._dynamo.reset()
    compiled = _grads(torch.compile(fn, backend="aot_eager", fullgraph=True), temb, weight, bias, ti, tag, upstream)
    assert_bitwise_equal((*compiled[0], *compiled[1]), (*eager[0], *eager[1]), "compiled vs eager")


def test_table_gradient_equals_one_sum_over_the_concatenation():
    """The backward sums the six chunks' gradients without copying them side by side: same bits as
    one segmented sum over the concatenation, missing gradients counting as zero."""
    from flowlock.ops.segment_sum.triton import segment_sum_fwd

    g = torch.Generator().manual_seed(21)
    s, h, t = 33, 40, 2
    ti, tag = torch.randint(0, t, (s,), generator=g), torch.randint(0, 3, (s,), generator=g)
    grads = [(torch.randn(s, h, generator=g) * 3).to(torch.bfloat16) for _ in range(6)]
    grads[4] = None
    full = torch.cat([torch.zeros(s, h, dtype=torch.bfloat16) if x is None else x for x in grads], dim=1)
    assert_bitwise_equal(adaln_triton.adaln_modulation_bwd(tuple(grads), ti, tag, 3 * t),
                         segment_sum_fwd(full, ti * 3 + tag, 3 * t))


def test_eager_calls_launch_directly_with_one_gather(monkeypatch):
    """Eager forward and backward skip the custom ops' dispatcher (host time at small S); the six
    chunks are gathered by one launch."""
    temb, weight, bias = adaln_params(2, 20, 24, seed=22)
    ti, tag = _indices(9, 2, seed=22)
    gathers = []
    kernel = adaln_triton._adaln_modulation_fwd_kernel
    monkeypatch.setattr(adaln_triton, "_adaln_modulation_fwd_kernel",
                        type("Counted", (), {"__getitem__": lambda _, grid: (gathers.append(grid), kernel[grid])[1]})())
    leaves = [x.clone().requires_grad_() for x in (temb, weight, bias)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with flowlock.use_backend("triton"):
            outs = adaln_modulation(*leaves, ti, tag)
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    assert not [e.name for e in prof.events() if e.name.startswith("flowlock::")]
    assert len(gathers) == 1


def test_repeatability_harness_catches_a_shuffled_fold():
    """Planted defect: d_act's chunk partials folded in a fresh random order on every call."""
    temb, weight, bias = adaln_params(2, 20, 24, seed=16)
    grad = torch.randn(2, 18 * 24, generator=torch.Generator().manual_seed(17)) * 1e3
    partials = [g @ w for g, w in zip(grad.split(16, dim=1), weight.float().split(16, dim=0))]

    def shuffled_fold():
        acc = torch.zeros_like(partials[0])
        for i in torch.randperm(len(partials)).tolist():
            acc = acc + partials[i]
        return acc
    assert repeat_failures(shuffled_fold, runs=20), "harness missed a shuffled fold order"


def _bad_cases():
    temb, weight, bias = adaln_params(2, 20, 24)
    ti, tag = _indices(7, 2)
    meta = torch.device("meta")
    # (name, args, error, whether adaln_table alone must refuse it too)
    return [
        ("fourth modality tag", (temb, weight, bias, ti, torch.tensor([0, 1, 2, 3, 0, 1, 2])), ValueError, False),
        ("index == T", (temb, weight, bias, torch.full((7,), 2), tag), ValueError, False),
        ("negative index", (temb, weight, bias, torch.full((7,), -1), tag), ValueError, False),
        ("negative tag", (temb, weight, bias, ti, torch.full((7,), -1)), ValueError, False),
        ("float index", (temb, weight, bias, ti.float(), tag), TypeError, False),
        ("tags length", (temb, weight, bias, ti, tag[:5]), ValueError, False),
        ("2-D index", (temb, weight, bias, ti.view(7, 1), tag), ValueError, False),
        ("index device", (temb, weight, bias, ti.to(meta), tag), ValueError, False),
        ("bf16 temb", (temb.to(torch.bfloat16), weight, bias, ti, tag), TypeError, True),
        ("fp64 weight", (temb, weight.double(), bias.double(), ti, tag), TypeError, True),
        ("fp32 bias with bf16 weight", (temb, weight, bias.float(), ti, tag), TypeError, True),
        ("weight rows not 18H", (temb, weight[:-1].contiguous(), bias[:-1].contiguous(), ti, tag), ValueError, True),
        ("E mismatch", (temb[:, :19].contiguous(), weight, bias, ti, tag), ValueError, True),
        ("bias length", (temb, weight, bias[:18].contiguous(), ti, tag), ValueError, True),
        ("temb 1-D", (temb[0], weight, bias, ti, tag), ValueError, True),
        ("non-contiguous temb", (temb.t().contiguous().t(), weight, bias, ti, tag), ValueError, True),
        ("weight device", (temb, weight.to(meta), bias, ti, tag), ValueError, True),
    ]


@pytest.mark.parametrize("case", range(len(_bad_cases())))
def test_bad_inputs_raise_before_any_launch(case, monkeypatch):
    name, args, error, table_too = _bad_cases()[case]
    launched = []
    for launcher in ("adaln_table_fwd", "adaln_modulation_fwd"):
        monkeypatch.setattr(adaln_triton, launcher, lambda *a, _n=launcher: launched.append(_n))
    before = [a.clone() for a in args]
    with flowlock.use_backend("triton"), pytest.raises(error):
        adaln_modulation(*args)
    if table_too:
        with flowlock.use_backend("triton"), pytest.raises(error):
            adaln_table(*args[:3])
    assert not launched, name
    for a, b in zip(args, before):
        if a.device.type != "meta":
            assert_bitwise_equal(a, b, name)
