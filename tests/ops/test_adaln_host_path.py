"""AdaLN host path: calls that record no autograd node give the node's bits; the activation's BF16
rounding moved into the kernels equals PyTorch's cast; the six-chunk table gradient (one partials
launch, one fold) equals the per-chunk segment sums it replaced, bit for bit."""

import pytest
import torch
from adaln_cases import adaln_params
from final_adaln_cases import final_adaln_inputs
from hypothesis import given, settings
from hypothesis import strategies as st

import flowlock
import flowlock.ops.adaln.table_grad as table_grad
import flowlock.ops.adaln.triton as adaln_triton
from flowlock.ops.adaln import adaln_modulation, adaln_table
from flowlock.ops.final_adaln import final_adaln_out
from flowlock.ops.segment_sum.fold import fold_partials
from flowlock.ops.segment_sum.triton import segment_sum_partials
from flowlock.testing import assert_bitwise_equal


def _indices(s, t, seed=0, dtype=torch.int64):
    g = torch.Generator().manual_seed(seed + 1)
    return (torch.randint(0, t, (s,), generator=g).to(dtype), torch.randint(0, 3, (s,), generator=g).to(dtype))


def _per_chunk_table_grad(grads, ti, tag, num_rows):
    """The previous backward, from segment_sum's public launchers: one segment sum per chunk (partials,
    then the shared fold), zeros for a missing gradient, the six placed side by side."""
    rows = ti.long() * 3 + tag.long()
    h = next(g.shape[1] for g in grads if g is not None)
    return torch.cat([fold_partials(segment_sum_partials(g.contiguous(), rows, num_rows)) if g is not None
                      else torch.zeros((num_rows, h)) for g in grads], dim=1)


def _check_table_grad(s, h, t, present, seed, idx_dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    ti, tag = _indices(s, t, seed, idx_dtype)
    grads = tuple((torch.randn(s, h, generator=g) * 100).to(torch.bfloat16) if (present >> c) & 1 else None
                  for c in range(6))
    with flowlock.use_backend("triton"):
        new = table_grad.adaln_modulation_bwd(grads, ti, tag, 3 * t)
    old = _per_chunk_table_grad(grads, ti, tag, 3 * t)
    assert new.shape == old.shape == (3 * t, 6 * h)
    assert torch.equal(new, old), f"S={s} H={h} T={t} present={present:06b}"


@pytest.mark.parametrize("s,h,t,present", [
    (1, 7, 1, 0b111111),
    (33, 40, 3, 0b101111),
    # 6 tiles of 64 rows: the interpreter's fold (GROUP 4) runs two levels, the last group ragged.
    (321, 33, 2, 0b111111),
    (65, 9, 1, 0b000001),
    (0, 5, 2, 0b100000),
])
def test_table_gradient_bitwise_equals_the_per_chunk_segment_sums(s, h, t, present):
    _check_table_grad(s, h, t, present, seed=s + h)


@settings(max_examples=12, deadline=None)
@given(s=st.integers(0, 140), h=st.sampled_from([1, 3, 17, 40]), t=st.integers(1, 3),
       present=st.integers(1, 63), seed=st.integers(0, 2**16), idx32=st.booleans())
def test_hypothesis_table_gradient_bitwise_equals_the_per_chunk_segment_sums(s, h, t, present, seed, idx32):
    _check_table_grad(s, h, t, present, seed, torch.int32 if idx32 else torch.int64)


def test_backward_is_one_partials_launch_and_one_fold(monkeypatch):
    """No per-chunk segment sum, no index arithmetic on the host: one partials launch, then the fold."""
    temb, weight, bias = adaln_params(2, 20, 24, seed=3)
    ti, tag = _indices(70, 2, seed=3)
    launches = []
    kernel = table_grad._adaln_table_grad_partials_kernel
    counted = type("Counted", (), {"__getitem__": lambda _, grid: (launches.append(grid), kernel[grid])[1]})
    monkeypatch.setattr(table_grad, "_adaln_table_grad_partials_kernel", counted())
    folds = []
    monkeypatch.setattr(table_grad, "fold_partials", lambda p: (folds.append(p.shape), fold_partials(p))[1])
    leaves = [x.clone().requires_grad_() for x in (temb, weight, bias)]
    with flowlock.use_backend("triton"):
        outs = adaln_modulation(*leaves, ti, tag)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.autograd.backward(outs[:2], [torch.ones_like(o) for o in outs[:2]])
    assert launches == [(2, 1)] and folds == [(2, 6, 6 * 24)]
    assert not [e.name for e in prof.events() if e.name in ("aten::mul", "aten::add", "aten::cat", "aten::zeros")]
    assert all(x.grad is not None for x in leaves)


def _no_apply(monkeypatch, cls):
    monkeypatch.setattr(cls, "apply", lambda *a: pytest.fail(f"{cls.__name__}.apply on a call without grad"))


def test_modulation_without_graph_equals_the_node(monkeypatch):
    temb, weight, bias = adaln_params(3, 20, 24, seed=5)
    ti, tag = _indices(33, 3, seed=5, dtype=torch.int32)
    with flowlock.use_backend("triton"):
        graph = adaln_modulation(*[x.clone().requires_grad_() for x in (temb, weight, bias)], ti, tag)
    _no_apply(monkeypatch, adaln_triton.AdalnModulationFunction)
    with flowlock.use_backend("triton"):
        with torch.no_grad():
            plain = adaln_modulation(temb, weight, bias, ti, tag)
        frozen = adaln_modulation(temb, weight, bias, ti, tag)
    for a, b, c in zip(graph, plain, frozen):
        assert a.grad_fn is not None and b.grad_fn is None and c.grad_fn is None
        assert torch.equal(a, b) and torch.equal(a, c)


def test_table_without_graph_equals_the_node(monkeypatch):
    temb, weight, bias = adaln_params(2, 36, 40, seed=6)
    with flowlock.use_backend("triton"):
        graph = adaln_table(*[x.clone().requires_grad_() for x in (temb, weight, bias)])
    _no_apply(monkeypatch, adaln_triton.AdalnTableFunction)
    with flowlock.use_backend("triton"), torch.no_grad():
        plain = adaln_table(temb, weight, bias)
    assert graph.grad_fn is not None and plain.grad_fn is None
    assert torch.equal(graph, plain)


def test_final_adaln_out_without_graph_equals_the_node(monkeypatch):
    import flowlock.ops.final_adaln.triton as final_triton

    x, temb, nw, w, b, ti = final_adaln_inputs(2, 7, 2, 20, 24, seed=8)
    with flowlock.use_backend("triton"):
        graph = final_adaln_out(*[v.clone().requires_grad_() for v in (x, temb, nw, w, b)], ti, 1e-6)
    _no_apply(monkeypatch, final_triton.FinalAdalnOutFunction)
    with flowlock.use_backend("triton"):
        with torch.no_grad():
            plain = final_adaln_out(x, temb, nw, w, b, ti, 1e-6)
        frozen = final_adaln_out(x, temb, nw, w, b, ti, 1e-6)
    assert graph.grad_fn is not None and plain.grad_fn is None and frozen.grad_fn is None
    assert torch.equal(graph, plain) and torch.equal(graph, frozen)


def _tie_heavy_activation(t, e, seed):
    """FP32 values of which about a third sit exactly halfway between two BF16 values."""
    g = torch.Generator().manual_seed(seed)
    act = torch.randn(t, e, generator=g)
    bits = act.view(torch.int32)
    ties = (bits & ~0xFFFF) | 0x8000
    pick = torch.randint(0, 3, (t, e), generator=g)
    return torch.where(pick == 0, ties, bits).view(torch.float32)


def test_kernel_rounding_of_the_activation_equals_torch_cast():
    """The projection kernels round an FP32 activation to BF16 exactly as ``.to(torch.bfloat16)``: the
    table and every gradient equal those from the BF16 activation."""
    t, e, n = 3, 37, 72
    act = _tie_heavy_activation(t, e, seed=9)
    temb, weight, bias = adaln_params(t, e, n // 18, seed=9)
    grad = torch.randn(t, n, generator=torch.Generator().manual_seed(10))
    with flowlock.use_backend("triton"):
        assert_bitwise_equal(adaln_triton.adaln_table_fwd(act, weight, bias),
                             adaln_triton.adaln_table_fwd(act.to(torch.bfloat16), weight, bias))
        assert_bitwise_equal(adaln_triton.adaln_table_bwd(grad, temb, act, weight),
                             adaln_triton.adaln_table_bwd(grad, temb, act.to(torch.bfloat16), weight))


def test_forward_casts_nothing_on_the_host():
    """SiLU is PyTorch's; its BF16 rounding happens in the projection kernel, not in a cast launch."""
    temb, weight, bias = adaln_params(2, 20, 24, seed=11)
    ti, tag = _indices(9, 2, seed=11)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with flowlock.use_backend("triton"), torch.no_grad():
            adaln_modulation(temb, weight, bias, ti, tag)
    names = [e.name for e in prof.events()]
    assert "aten::silu" in names and "aten::_to_copy" not in names
