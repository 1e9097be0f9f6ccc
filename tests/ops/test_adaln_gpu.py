"""AdaLN family on a CUDA GPU (compiled Triton) at H3 widths: rows pure for every T, diffusers parity
given the table, gradients repeatable and within budget of an FP64 golden against cuBLAS eager."""

import pytest
import torch
from diffusers.models.transformers.transformer_minimax_h3 import (
    MiniMaxH3AdaLayerNormModulation,
    MiniMaxH3AdaLayerNormOut,
)

from flowlock.ops.adaln import adaln_modulation, adaln_table
from flowlock.ops.adaln.reference import adaln_modulation_golden
from flowlock.ops.adaln.triton import AdalnTableFunction
from flowlock.ops.final_adaln import final_adaln_out
from flowlock.ops.rms_norm import rms_norm
from flowlock.testing import (
    assert_bitwise_equal,
    assert_repeatable,
    assert_within_budget,
    max_abs_error,
    mismatch_count,
)

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
H, E, S, EPS = 5376, 2688, 1031, 1e-6


def _params(t, rows_per_h=18, seed=0):
    g = torch.Generator().manual_seed(seed)
    temb = torch.randn(t, E, generator=g)
    weight = (torch.randn(rows_per_h * H, E, generator=g) * E ** -0.5).to(torch.bfloat16)
    bias = (torch.randn(rows_per_h * H, generator=g) * 0.2).to(torch.bfloat16)
    return [x.to(DEVICE) for x in (temb, weight, bias)]


def _indices(t, seed=0):
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randint(0, t, (S,), generator=g).to(DEVICE), torch.randint(0, 3, (S,), generator=g).to(DEVICE)


def test_table_rows_pure_for_every_t():
    temb, weight, bias = _params(19)
    for t in (1, 2, 3, 8, 16, 17, 19):
        table = adaln_table(temb[:t], weight, bias).view(t, -1)
        for i in range(t):
            assert_bitwise_equal(table[i], adaln_table(temb[i:i + 1], weight, bias).view(-1), f"T={t} row {i}")


class _FixedProjection(torch.nn.Module):
    """Stands in for a diffusers AdaLN ``linear``: returns a given table, stored in BF16."""

    def __init__(self, table):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, dtype=torch.bfloat16, device=DEVICE))
        self.table = table.to(torch.bfloat16)

    def forward(self, act):
        return self.table


def test_modulation_equals_diffusers_given_the_table():
    temb, weight, bias = _params(2)
    ti, tag = _indices(2)
    table = AdalnTableFunction.apply(temb, weight, bias)
    module = MiniMaxH3AdaLayerNormModulation(E, H).to(DEVICE, torch.bfloat16)
    module.linear = _FixedProjection(table)
    want = tuple(c.index_select(0, ti * 3 + tag) for c in module(temb))
    assert_bitwise_equal(adaln_modulation(temb, weight, bias, ti, tag), want)


def _mod_grads(fn, temb, weight, bias, ti, tag, upstream):
    leaves = [x.detach().clone().requires_grad_(True) for x in (temb, weight, bias)]
    outs = fn(*leaves, ti, tag)
    sum((o.double() * u.double()).sum() for o, u in zip(outs, upstream)).backward()
    return [x.grad for x in leaves]


def _eager(temb, weight, bias, ti, tag):
    module = MiniMaxH3AdaLayerNormModulation(E, H).to(DEVICE, torch.bfloat16)
    chunks = torch.func.functional_call(module, {"linear.weight": weight, "linear.bias": bias}, (temb,))
    return tuple(c.index_select(0, ti * 3 + tag) for c in chunks)


def test_modulation_gradients_repeatable_and_within_budget():
    temb, weight, bias = _params(2)
    ti, tag = _indices(2)
    g = torch.Generator().manual_seed(5)
    upstream = [torch.randn(S, H, generator=g).to(torch.bfloat16).to(DEVICE) for _ in range(6)]
    assert_repeatable(lambda: _mod_grads(adaln_modulation, temb, weight, bias, ti, tag, upstream), runs=20)
    mine = _mod_grads(adaln_modulation, temb, weight, bias, ti, tag, upstream)
    eager = _mod_grads(_eager, temb, weight, bias, ti, tag, upstream)
    golden = _mod_grads(adaln_modulation_golden, temb.double(), weight.double(), bias.double(), ti, tag, upstream)
    for name, m, e, gold in zip(("d_temb", "dW", "db"), mine, eager, golden):
        assert_within_budget(m, gold, baseline=e, what=name)
        assert max_abs_error(m, gold) <= max_abs_error(e, gold), name


def test_final_adaln_out_equals_diffusers_given_table_and_norm_and_is_repeatable():
    temb, weight, bias = _params(2, rows_per_h=2, seed=3)
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(2, S, H, generator=g) * 3).to(torch.bfloat16).to(DEVICE)
    norm_weight = (torch.rand(H, generator=g) + 0.5).to(torch.bfloat16).to(DEVICE)
    ti = torch.randint(0, 2, (S,), generator=g).to(DEVICE)
    dy = torch.randn(2, S, H, generator=g).to(torch.bfloat16).to(DEVICE)
    y = final_adaln_out(x, temb, norm_weight, weight, bias, ti, EPS)
    with torch.no_grad():
        # diffusers' modulation arithmetic on the same table and the same normalized x (the norm
        # itself is the norms family's promise, about one ulp from cuBLAS-era eager).
        shift, scale = AdalnTableFunction.apply(temb, weight, bias).to(torch.bfloat16).chunk(2, dim=-1)
        normed = rms_norm(x, norm_weight, EPS)
        want = normed * (1.0 + scale.index_select(0, ti)) + shift.index_select(0, ti)
        module = MiniMaxH3AdaLayerNormOut(H, E, EPS).to(DEVICE, torch.bfloat16)
        module.norm.weight.copy_(norm_weight)
        module.linear = _FixedProjection(torch.cat([shift, scale], dim=-1))
        print(f"final_adaln_out vs diffusers given the table: {mismatch_count(y, module(x, temb, ti))} "
              f"of {y.numel()} elements differ")
    assert_bitwise_equal(y, want, "final_adaln_out vs diffusers' modulation given the table and norm")

    def grads():
        leaves = [t.detach().clone().requires_grad_(True) for t in (x, temb, norm_weight, weight, bias)]
        final_adaln_out(*leaves, ti, EPS).backward(dy)
        return [t.grad for t in leaves]
    assert_repeatable(grads, runs=20)


def test_table_gradient_equals_the_per_chunk_segment_sums():
    """Compiled: the one six-chunk partials launch reduces every chunk with segment_sum's own tiles and
    tree, so the table gradient equals the per-chunk segment sums bit for bit."""
    from flowlock.ops.adaln.table_grad import adaln_modulation_bwd
    from flowlock.ops.segment_sum.triton import segment_sum_fwd

    t = 3
    ti, tag = _indices(t, seed=31)
    g = torch.Generator().manual_seed(32)
    grads = [(torch.randn(S, H, generator=g) * 100).to(torch.bfloat16).to(DEVICE) for _ in range(6)]
    grads[2] = None
    rows = ti.long() * 3 + tag.long()
    per_chunk = torch.cat([segment_sum_fwd(x, rows, 3 * t) if x is not None
                           else torch.zeros(3 * t, H, device=DEVICE) for x in grads], dim=1)
    assert_bitwise_equal(adaln_modulation_bwd(tuple(grads), ti, tag, 3 * t), per_chunk)


def test_kernel_rounding_of_the_activation_equals_torch_cast():
    """Compiled: the projection kernels' BF16 rounding of the FP32 SiLU equals ``.to(torch.bfloat16)``."""
    from flowlock.ops.adaln.triton import adaln_table_bwd, adaln_table_fwd

    temb, weight, bias = _params(3)
    act = torch.nn.functional.silu(temb)
    grad = torch.randn(3, 18 * H, generator=torch.Generator().manual_seed(33)).to(DEVICE)
    assert_bitwise_equal(adaln_table_fwd(act, weight, bias), adaln_table_fwd(act.to(torch.bfloat16), weight, bias))
    assert_bitwise_equal(adaln_table_bwd(grad, temb, act, weight),
                         adaln_table_bwd(grad, temb, act.to(torch.bfloat16), weight))
