"""attention: accuracy of forward and gradients vs the FP64 golden, batch invariance, row purity and
repeatability (each harness shown to catch a planted failure), strided inputs, bad inputs."""

import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import flowlock
from flowlock.config import LaunchConfig
from flowlock.ops.attention import attention, attention_golden, attention_reference
from flowlock.ops.attention import reference as attention_reference_module
from flowlock.ops.attention.reference import LOG2E
from flowlock.ops.attention.triton import attention_fwd
from flowlock.testing import (
    assert_batch_invariant,
    assert_bitwise_equal,
    assert_within_budget,
    batch_invariance_failures,
    bitwise_equal,
    repeat_failures,
)


def _tiles(block_m, block_n):
    return LaunchConfig((("BLOCK_M", block_m), ("BLOCK_N", block_n)), num_warps=4)


def _qkv(b, s, h, d, seed=0, grad=True):
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(b, s, h, d, generator=g).bfloat16() for _ in range(4))
    if grad:
        for t in (q, k, v):
            t.requires_grad_(True)
    return q, k, v, do


def _fwd_bwd(fn, q, k, v, do):
    out = fn(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), do))


def _triton(q, k, v, **kw):
    with flowlock.use_backend("triton"):
        return attention(q, k, v, **kw)


def _sdpa(q, k, v):
    """The provider's eager bf16 baseline (CPU SDPA), in BSHD."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def _golden(q, k, v, do, scale=None):
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = attention_golden(*leaves, scale, torch.bfloat16)
    return (out.detach(), *torch.autograd.grad(out, leaves, do.double()))


SHAPES = [(1, 1, 2, 32), (2, 7, 1, 128), (3, 33, 1, 32), (1, 32, 1, 64), (1, 70, 2, 128)]


@pytest.mark.parametrize("b,s,h,d", SHAPES)
def test_triton_forward_and_grads_within_budget(b, s, h, d):
    q, k, v, do = _qkv(b, s, h, d, seed=s)
    ours = _fwd_bwd(_triton, q, k, v, do)
    base = _fwd_bwd(_sdpa, q, k, v, do)
    gold = _golden(q, k, v, do)
    for name, o, bl, g in zip(("out", "dq", "dk", "dv"), ours, base, gold):
        assert o.dtype == torch.bfloat16 and o.shape == (b, s, h, d)
        if s == 1 and name in ("dq", "dk"):
            continue  # exactly zero in the golden: see test_single_key_dq_dk_are_only_cancellation_residue
        assert_within_budget(o, g, out_dtype=torch.bfloat16, baseline=bl, what=f"attention {name}")


def test_single_key_dq_dk_are_only_cancellation_residue():
    """With one key dq and dk are exactly 0, but the kernel forms dP - delta from two fp32 dot
    products of the same vectors (dO.V and dO.O, O = V) summed in different orders: the residue is
    bounded by twice the fp32 summation error of D products, times scale * |k| (dq) or |q| (dk)."""
    q, k, v, do = _qkv(3, 1, 2, 128, seed=11)
    _, dq, dk, _ = _fwd_bwd(_triton, q, k, v, do)
    d = q.shape[-1]
    residue = (d ** -0.5) * 2 * d * 2.0 ** -24 * (do.float() * v.float()).abs().sum(-1, keepdim=True) * (1 + 2.0 ** -8)
    assert bool((dq.float().abs() <= residue * k.detach().float().abs()).all())
    assert bool((dk.float().abs() <= residue * q.detach().float().abs()).all())


@pytest.mark.parametrize("b,s,h,d", [(2, 33, 1, 32)])
def test_reference_within_budget_and_chunked(b, s, h, d, monkeypatch):
    q, k, v, do = _qkv(b, s, h, d, seed=1)
    whole = _fwd_bwd(attention, q, k, v, do)
    # rows per chunk = max(1, 200 // s): several checkpointed chunks, each row still computed alone
    monkeypatch.setattr(attention_reference_module, "_CHUNK_ELEMENTS", 200)
    chunked = _fwd_bwd(attention, q, k, v, do)
    base = _fwd_bwd(_sdpa, q, k, v, do)
    for name, o, c, bl, g in zip(("out", "dq", "dk", "dv"), whole, chunked, base, _golden(q, k, v, do)):
        assert_within_budget(o, g, out_dtype=torch.bfloat16, baseline=bl, what=f"reference {name}")
        assert_within_budget(c, g, out_dtype=torch.bfloat16, baseline=bl, what=f"chunked reference {name}")


def test_backend_choice_is_recorded():
    q, k, v, _ = _qkv(1, 7, 1, 32, grad=False)
    with flowlock.mode("strict") as handle:
        ref = attention(q, k, v)
        tri = _triton(q, k, v)
    assert handle.ran == [("attention", "reference"), ("attention", "triton")]
    assert_bitwise_equal(ref, attention_reference(q, k, v, 32 ** -0.5))
    assert tri.is_contiguous()


def test_explicit_scale_matches_golden():
    q, k, v, do = _qkv(2, 33, 1, 64, seed=3)
    ours = _fwd_bwd(lambda a, b, c: _triton(a, b, c, scale=0.3), q, k, v, do)
    base = _fwd_bwd(lambda a, b, c: F.scaled_dot_product_attention(
        a.transpose(1, 2), b.transpose(1, 2), c.transpose(1, 2), scale=0.3).transpose(1, 2), q, k, v, do)
    for name, o, bl, g in zip(("out", "dq", "dk", "dv"), ours, base, _golden(q, k, v, do, scale=0.3)):
        assert_within_budget(o, g, out_dtype=torch.bfloat16, baseline=bl, what=f"scale 0.3 {name}")


def test_fused_qkv_views_equal_contiguous_inputs():
    b, s, h, d = 2, 20, 2, 32
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(b, s, 3 * h * d, generator=g).bfloat16().requires_grad_(True)
    do = torch.randn(b, s, h, d, generator=g).bfloat16()
    q, k, v = (t.unflatten(-1, (h, d)) for t in qkv.chunk(3, dim=-1))
    assert not q.is_contiguous()
    out = _triton(q, k, v)
    (dqkv,) = torch.autograd.grad(out, qkv, do)
    qc, kc, vc = (t.detach().contiguous().requires_grad_(True) for t in (q, k, v))
    ref = _fwd_bwd(_triton, qc, kc, vc, do)
    assert_bitwise_equal(out, ref[0], "fused-qkv forward")
    assert_bitwise_equal(tuple(t.unflatten(-1, (h, d)) for t in dqkv.chunk(3, dim=-1)), ref[1:], "fused-qkv grads")


def test_strided_incoming_gradient():
    q, k, v, do = _qkv(1, 20, 2, 32, seed=5)
    expanded = do[:, :, :1].expand(-1, -1, 2, -1)
    strided = do.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert strided.stride(-1) != 1
    for grad_out in (expanded, strided):
        got = _fwd_bwd(_triton, q, k, v, grad_out)
        want = _fwd_bwd(_triton, q, k, v, grad_out.contiguous())
        assert_bitwise_equal(got, want, "strided dO")


def test_compiled_equals_eager():
    """torch.compile sees the forward and backward as two opaque custom ops: same bits as eager."""
    q, k, v, do = _qkv(2, 20, 2, 32, seed=12)
    fn = lambda a, b, c: _triton(a * 1, b, c)
    eager = _fwd_bwd(fn, q, k, v, do)
    torch._dynamo.reset()
    compiled = _fwd_bwd(torch.compile(fn, backend="aot_eager", fullgraph=True), q, k, v, do)
    assert_bitwise_equal(compiled, eager, "compiled vs eager")


def _pool(n=4, s=20, h=1, d=32):
    q, k, v, do = _qkv(n, s, h, d, seed=6, grad=False)
    return q, k, v, do


def _triton_fwd_bwd(q, k, v, do):
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    return _fwd_bwd(_triton, *leaves, do)


def _planted_batch_dependent(q, k, v, do):
    """Forward whose KV block size (hence fold order) depends on the batch size."""
    cfg = _tiles(16, 16 if q.shape[0] == 1 else 32)
    return attention_fwd(q, k, v, q.shape[-1] ** -0.5, cfg)[0]


def test_batch_invariant_forward_and_grads():
    assert_batch_invariant(_triton_fwd_bwd, _pool(), sizes=(2, 4))


def test_batch_harness_catches_planted_batch_dependent_order():
    assert batch_invariance_failures(_planted_batch_dependent, _pool(), sizes=(2, 3)), "harness missed a plant"


@settings(max_examples=4, deadline=None)
@given(b=st.integers(2, 3), s=st.integers(1, 24), h=st.integers(1, 2), pos=st.integers(0, 2),
       seed=st.integers(0, 2**16))
def test_hypothesis_sample_alone_equals_sample_in_batch(b, s, h, pos, seed):
    q, k, v, do = _qkv(b, s, h, 32, seed=seed, grad=False)
    pos = pos % b
    batch = _triton_fwd_bwd(q, k, v, do)
    alone = _triton_fwd_bwd(*(t[pos:pos + 1] for t in (q, k, v, do)))
    assert_bitwise_equal(tuple(t[pos:pos + 1] for t in batch), alone, f"sample {pos} of {b}")


def _row_purity_failures(fn, q, k, v, do, seed=7):
    """Replace the odd query rows (and their dO) and list the outputs whose even rows changed.

    ``fn(q, k, v, do)`` returns tensors whose dim 1 indexes query rows (out, dq)."""
    g = torch.Generator().manual_seed(seed)
    q2, do2 = q.clone(), do.clone()
    q2[:, 1::2] = torch.randn(q2[:, 1::2].shape, generator=g).bfloat16()
    do2[:, 1::2] = torch.randn(do2[:, 1::2].shape, generator=g).bfloat16()
    return [f"output {i}" for i, (a, b) in enumerate(zip(fn(q, k, v, do), fn(q2, k, v, do2)))
            if not bitwise_equal(a[:, ::2], b[:, ::2])]


def _triton_out_dq(q, k, v, do):
    out, dq, _, _ = _triton_fwd_bwd(q, k, v, do)
    return out, dq


def _planted_shared_max(q, k, v, do):
    """Softmax shifted by one maximum shared by all rows: same maths, but each row's rounding of
    ``P`` now depends on the other rows."""
    scores = (q.float().transpose(1, 2) @ k.float().transpose(1, 2).transpose(-1, -2)) * (q.shape[-1] ** -0.5 * LOG2E)
    p = torch.exp2(scores - scores.amax())
    out = (p.bfloat16().float() @ v.float().transpose(1, 2)) / p.sum(-1, keepdim=True)
    return (out.transpose(1, 2).bfloat16(),)


@pytest.mark.parametrize("s", [7, 33])
def test_rows_are_pure(s):
    q, k, v, do = _qkv(2, s, 1, 32, seed=s, grad=False)
    assert _row_purity_failures(_triton_out_dq, q, k, v, do) == []


def test_row_purity_harness_catches_planted_shared_max():
    q, k, v, do = _qkv(2, 33, 1, 32, seed=8, grad=False)
    assert _row_purity_failures(_planted_shared_max, q, k, v, do), "harness missed a plant"


def test_gradients_repeatable():
    q, k, v, do = _qkv(1, 33, 1, 32, seed=9)
    assert repeat_failures(lambda: _fwd_bwd(_triton, q, k, v, do), runs=3) == []


def test_repeat_harness_catches_planted_varying_order():
    q, k, v, _ = _qkv(1, 33, 1, 32, seed=10, grad=False)
    calls = []

    def planted():
        """Forward whose KV block size alternates from call to call."""
        calls.append(None)
        return attention_fwd(q, k, v, 32 ** -0.5, _tiles(16, 16 * (1 + len(calls) % 2)))

    assert repeat_failures(planted, runs=3), "harness missed a plant"


def _bad_calls():
    q, k, v, _ = _qkv(1, 7, 2, 32, grad=False)
    wide = torch.randn(1, 7, 32, 2).bfloat16().transpose(-1, -2)
    many_heads = torch.zeros(1, 1, 65536, 32, dtype=torch.bfloat16)
    return [
        ((q.double(), k, v), {}, TypeError, "q"),
        ((q, k.half(), v), {}, TypeError, "k"),
        (([1.0], k, v), {}, TypeError, "q"),
        ((q[0], k[0], v[0]), {}, ValueError, "q"),
        ((q, k[:, :6], v), {}, ValueError, "k"),
        ((q, k, v[..., :16]), {}, ValueError, "v"),
        ((q[:, :0], k[:, :0], v[:, :0]), {}, ValueError, "q"),
        ((wide, wide, wide), {}, ValueError, "q"),
        ((q, k, v.to("meta")), {}, ValueError, "v"),
        ((many_heads,) * 3, {}, ValueError, "B * heads"),
        ((q, k, v), {"scale": "0.5"}, TypeError, "scale"),
        ((q, k, v), {"scale": True}, TypeError, "scale"),
        ((q, k, v), {"scale": -1.0}, ValueError, "scale"),
        ((q, k, v), {"scale": float("nan")}, ValueError, "scale"),
        ((q, k, v), {"scale": float("inf")}, ValueError, "scale"),
        ((q, k, v), {"scale": 0}, ValueError, "scale"),
    ]


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("case", range(len(_bad_calls())))
def test_bad_inputs_raise_before_any_work(backend, case):
    args, kwargs, error, name = _bad_calls()[case]
    before = [t.clone() if isinstance(t, torch.Tensor) and t.device.type != "meta" else t for t in args]
    with flowlock.use_backend(backend), pytest.raises(error, match=re.escape(name)):
        attention(*args, **kwargs)
    for a, b in zip(args, before):
        if isinstance(a, torch.Tensor) and a.device.type != "meta":
            assert_bitwise_equal(a, b, "input changed")
