"""attention variants and host path: the TMA-descriptor kernels give the pointer kernels' bits
(forward and backward, ragged tails, fused-qkv views, several samples), the layout rule that picks
the pointer variant, and the no-graph fast path that skips the autograd node."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flowlock
from flowlock.config import LaunchConfig, launch_config
from flowlock.ops.attention import api as attention_api
from flowlock.ops.attention import attention, gluon_bwd, gluon_fwd
from flowlock.ops.attention import triton as attention_triton
from flowlock.ops.attention.triton import attention_bwd, attention_fwd, tma_eligible
from flowlock.testing import assert_bitwise_equal, bitwise_equal

SCALE = 0.3


def _cfg(block_m, block_n, tma, dp_first=0):
    return LaunchConfig((("BLOCK_M", block_m), ("BLOCK_N", block_n), ("DP_FIRST", dp_first), ("TMA", int(tma))),
                        num_warps=4)


def _fused(b, s, h, d, seed):
    """q, k, v as column views of one fused (B, S, 3 * heads * D) projection, and a dO."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(b, s, 3 * h * d, generator=g).bfloat16()
    do = torch.randn(b, s, h, d, generator=g).bfloat16()
    q, k, v = (t.unflatten(-1, (h, d)) for t in qkv.chunk(3, dim=-1))
    return q, k, v, do


def _run(q, k, v, do, fwd_cfg, dkdv_cfg, dq_cfg):
    """out, lse2, dq, dk, dv through the launchers with explicit configs."""
    out, lse2 = attention_fwd(q, k, v, SCALE, fwd_cfg)
    return (out, lse2, *attention_bwd(do, q, k, v, out, lse2, SCALE, dkdv_cfg, dq_cfg))


def _variant_mismatches(inputs, a, b):
    """Names of the outputs whose bits differ between config triples ``a`` and ``b``."""
    names = ("out", "lse2", "dq", "dk", "dv")
    return [n for n, x, y in zip(names, _run(*inputs, *a), _run(*inputs, *b)) if not bitwise_equal(x, y)]


TMA = (_cfg(16, 32, 1), _cfg(16, 16, 1), _cfg(32, 16, 1))
POINTER = (_cfg(16, 32, 0), _cfg(16, 16, 0), _cfg(32, 16, 0))


@pytest.mark.parametrize("b,s,h,d", [(2, 1, 2, 32), (1, 7, 3, 64), (2, 33, 2, 32)])
def test_tma_variant_equals_pointer_variant(b, s, h, d, monkeypatch):
    inputs = _fused(b, s, h, d, seed=s)
    assert all(tma_eligible(t) for t in inputs)
    boxes = []

    class Spy(attention_triton.TensorDescriptor):
        def __post_init__(self):
            boxes.append(tuple(self.block_shape))
            super().__post_init__()

    monkeypatch.setattr(attention_triton, "TensorDescriptor", Spy)
    assert _variant_mismatches(inputs, TMA, POINTER) == []
    # forward q, k, v; dK/dV and dQ each q, k, v, dO; none for the pointer configs
    assert sorted(boxes) == sorted([(1, 16, d), (1, 32, d), (1, 32, d)] + [(1, 16, d)] * 4
                                   + [(1, 32, d), (1, 16, d), (1, 16, d), (1, 32, d)])


def test_variant_comparison_catches_planted_fold_order():
    """A 'variant' whose forward folds the keys in 16-row blocks instead of 32 changes the bits."""
    inputs = _fused(1, 33, 1, 32, seed=2)
    planted = (_cfg(16, 16, 1), *TMA[1:])
    assert _variant_mismatches(inputs, POINTER, planted), "comparison missed a plant"


@pytest.mark.parametrize("tma", [0, 1])
@pytest.mark.parametrize("b,s,h", [(1, 1, 1), (2, 33, 2)])
def test_dp_first_order_gives_the_same_bits(b, s, h, tma):
    """Issuing dP before the exponentials (a scheduling choice for the tensor cores) changes no value."""
    inputs = _fused(b, s, h, 32, seed=s + tma)
    early = (_cfg(16, 32, tma), _cfg(16, 16, tma, dp_first=1), _cfg(32, 16, tma, dp_first=1))
    assert _variant_mismatches(inputs, early, TMA if tma else POINTER) == []


@settings(max_examples=4, deadline=None)
@given(b=st.integers(1, 3), s=st.integers(1, 40), h=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_hypothesis_tma_variant_equals_pointer_variant(b, s, h, seed):
    assert _variant_mismatches(_fused(b, s, h, 32, seed), TMA, POINTER) == []


def test_tma_variant_sample_alone_equals_sample_in_batch():
    inputs = _fused(3, 20, 2, 32, seed=3)
    batch = _run(*inputs, *TMA)
    for i in range(3):
        alone = _run(*(t[i:i + 1] for t in inputs), *TMA)
        assert_bitwise_equal(tuple(t[i:i + 1] for t in batch), alone, f"sample {i} of 3")


def _layouts():
    """(name, tensor, eligible) for the layout rule."""
    q, _, _, do = _fused(2, 9, 2, 32, seed=4)
    base = torch.randn(2 * 9 * 2 * 32 + 1).bfloat16()
    return [
        ("contiguous", do, True),
        ("fused-qkv view", q, True),
        ("head-major (BHSD transposed)", do.transpose(1, 2).contiguous().transpose(1, 2), False),
        ("expanded heads", do[:, :, :1].expand(-1, -1, 2, -1), False),
        ("base not 16-byte aligned", base[1:].view(2, 9, 2, 32), False),
        ("row stride not a 16-byte multiple", torch.randn(2, 9, 2 * 32 + 1).bfloat16()[..., :64].unflatten(-1, (2, 32)),
         False),
    ]


@pytest.mark.parametrize("case", range(len(_layouts())))
def test_layout_rule(case):
    name, t, eligible = _layouts()[case]
    assert tma_eligible(t) == eligible, name


@pytest.mark.parametrize("case", [i for i, (_, _, ok) in enumerate(_layouts()) if not ok])
def test_ineligible_layouts_run_the_pointer_variant_with_the_same_bits(case):
    _, t, _ = _layouts()[case]
    _, k, v, do = _fused(2, 9, 2, 32, seed=5)
    q = t
    contiguous = _run(q.contiguous(), k, v, do, *POINTER)
    assert_bitwise_equal(_run(q, k, v, do, *TMA), contiguous, "TMA config on an ineligible q")
    assert_bitwise_equal(_run(do, k, v, q, *TMA), _run(do, k, v, q.contiguous(), *POINTER),
                         "TMA config on an ineligible dO")


def test_no_graph_call_launches_directly_with_the_same_bits(monkeypatch):
    q, k, v, _ = _fused(2, 17, 2, 32, seed=6)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    with flowlock.use_backend("triton"):
        graphed = attention(*leaves)
        assert graphed.grad_fn is not None

        def no_function(*args):
            raise AssertionError("Function.apply on a call that records no graph")

        monkeypatch.setattr(attention_api.AttentionFunction, "apply", no_function)
        plain = attention(q, k, v)
        with torch.no_grad():
            no_grad = attention(*leaves)
    assert plain.grad_fn is None and no_grad.grad_fn is None
    assert_bitwise_equal((plain, no_grad), (graphed.detach(), graphed.detach()), "no-graph path")


def test_frozen_configs_pick_pointer_loads_on_the_interpreter_and_tma_on_sm90():
    for op in ("attention_fwd", "attention_bwd_dkdv", "attention_bwd_dq"):
        for d in (32, 64, 128):
            assert launch_config(op, torch.bfloat16, "interp", (d,))["TMA"] == 0
            assert launch_config(op, torch.bfloat16, "sm90", (d,))["TMA"] == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_frozen_sm90_forward_at_d128_is_the_gluon_kernel_on_its_tiles(dtype):
    """D = 128 forwards run the Gluon kernel (GLUON=1), whose bits are the Triton forward's on the same
    128 x 128 tiles, so the config's tiles must be its tiles: the operands it does not serve (padded
    heads, head-major views) run the Triton forward of those tiles. Other head dims keep the Triton
    forward."""
    for d in (16, 32, 64, 128, 256):
        fwd = launch_config("attention_fwd", dtype, "sm90", (d,))
        if d != gluon_fwd.HEAD_DIM:
            assert "GLUON" not in dict(fwd.blocks), f"D={d}"
            continue
        assert fwd["GLUON"] == 1 and fwd["TMA"] == 1
        assert (fwd["BLOCK_M"], fwd["BLOCK_N"]) == (gluon_fwd.BLOCK_M, gluon_fwd.BLOCK_N)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_frozen_sm90_backward_is_one_pass_with_a_dq_kernel_of_its_sum(dtype):
    """D = 128 backwards run the one-pass kernel, and the dQ kernel that serves the operands it does not
    (head-major views, padded heads) sums dQ as it does: terms of its KV block width, folded (DQ_FOLD=1);
    its dK/dV tiles are the one-pass kernel's steps. Other head dims keep the separate kernels."""
    for d in (16, 32, 64, 128, 256):
        dkdv = launch_config("attention_bwd_dkdv", dtype, "sm90", (d,))
        dq = launch_config("attention_bwd_dq", dtype, "sm90", (d,))
        if d != gluon_bwd.HEAD_DIM:
            assert "ONE_PASS" not in dict(dkdv.blocks), f"D={d}"
            continue
        assert dkdv["ONE_PASS"] > 0
        assert (dkdv["BLOCK_M"], dkdv["BLOCK_N"]) == (gluon_bwd.BLOCK_M, gluon_bwd.BLOCK_N)
        assert (dq["DQ_FOLD"], dq["BLOCK_N"]) == (1, gluon_bwd.BLOCK_N)
