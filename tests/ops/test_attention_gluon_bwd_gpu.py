"""The one-pass Gluon attention backward (flowlock.ops.attention.gluon_bwd), the frozen sm90 backward at
D = 128, on a Hopper GPU: dK and dV are the Triton dK/dV kernel's bits, dQ is the frozen Triton dQ
kernel's (``DQ_FOLD=1`` on 128-row KV blocks: per-block terms from zero, folded in ascending order), at
the frozen ticket grouping and another, compared as raw bits at sequence lengths
with a partial last KV and query block (925, 4253, 65, 1), whole blocks (4096, 64), two samples, views of
a fused qkv projection, bf16 and fp16, and gradients small enough that the fold's sums are subnormal
(both keep them); repeated launches agree, and a sample alone equals itself in a batch.

    TRITON_INTERPRET=0 python -m pytest -q -m gpu tests/ops/test_attention_gluon_bwd_gpu.py
"""


import pytest
import torch

from flowlock.config import launch_config
from flowlock.ops.attention import gluon_bwd
from flowlock.ops.attention import triton as at
from flowlock.testing import bitwise_equal

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                       reason="needs a Hopper (sm90) GPU"),
]

HEADS = 8
SCALE = 128 ** -0.5


def _operands(batch, seq, dtype, fused, heads=HEADS):
    g = torch.Generator(device="cuda").manual_seed(seq + 7 * batch)
    if fused:
        qkv = torch.randn(batch, seq, 3, heads, 128, generator=g, device="cuda").to(dtype)
        q, k, v = qkv.unbind(2)
    else:
        q, k, v = (torch.randn(batch, seq, heads, 128, generator=g, device="cuda").to(dtype) for _ in range(3))
    dout = torch.randn(batch, seq, heads, 128, generator=g, device="cuda").to(dtype)
    return q, k, v, dout


def _triton_fold(q, k, v, dout, out, lse2):
    """The separate Triton kernels (the dK/dV config without the one-pass kernel) with the frozen dQ config,
    which folds dQ per 128-row KV block."""
    dkdv_cfg = launch_config("attention_bwd_dkdv", q.dtype, "sm90", (128,)).with_blocks(ONE_PASS=0)
    dq_cfg = launch_config("attention_bwd_dq", q.dtype, "sm90", (128,))
    assert (dq_cfg["BLOCK_N"], dq_cfg["DQ_FOLD"]) == (gluon_bwd.BLOCK_N, 1), "the frozen dQ is not the fold"
    return at.attention_bwd(dout, q, k, v, out, lse2, SCALE, dkdv_config=dkdv_cfg, dq_config=dq_cfg)


def _one_pass(q, k, v, dout, out, lse2, group=None):
    """``attention_bwd`` with the frozen configs (the one-pass kernel on these operands) or, given ``group``,
    the one-pass kernel with tickets in groups of ``group`` heads."""
    dkdv_cfg = None
    if group is not None:
        dkdv_cfg = launch_config("attention_bwd_dkdv", q.dtype, "sm90", (128,)).with_blocks(ONE_PASS=group)
    return at.attention_bwd(dout, q, k, v, out, lse2, SCALE, dkdv_config=dkdv_cfg)


def test_frozen_backward_runs_the_one_pass_kernel(monkeypatch):
    """The frozen sm90 configs send TMA-eligible D = 128 operands to the one-pass kernel, and head-major
    views of the same values (not TMA-eligible) to the separate kernels: the same dq, dk, dv."""
    q, k, v, dout = _operands(1, 925, torch.bfloat16, False)
    out, lse2 = at.attention_fwd(q, k, v, SCALE)
    calls = []
    real = gluon_bwd.attention_bwd_one_pass
    monkeypatch.setattr(gluon_bwd, "attention_bwd_one_pass", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    eligible = at.attention_bwd(dout, q, k, v, out, lse2, SCALE)
    assert len(calls) == 1, "the frozen backward did not run the one-pass kernel"
    head_major = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v, dout)]
    assert not any(at.tma_eligible(t) for t in head_major)
    other = at.attention_bwd(head_major[3], *head_major[:3], out, lse2, SCALE)
    assert len(calls) == 1, "head-major operands reached the one-pass kernel"
    for name, a, b in zip(("dq", "dk", "dv"), eligible, other):
        assert bitwise_equal(a, b), f"{name}: one-pass vs separate kernels on head-major views"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch, seq, fused", [(1, 925, False), (1, 4253, True), (1, 4096, False), (2, 200, False),
                                               (1, 65, False), (1, 64, True), (1, 1, False)])
def test_one_pass_gives_the_folded_triton_bits(batch, seq, fused, dtype):
    q, k, v, dout = _operands(batch, seq, dtype, fused)
    assert all(at.tma_eligible(t) for t in (q, k, v, dout)) and gluon_bwd.applies(q)
    out, lse2 = at.attention_fwd(q, k, v, SCALE)
    want = _triton_fold(q, k, v, dout, out, lse2)
    for group in (None, 8):
        got = _one_pass(q, k, v, dout, out, lse2, group)
        for name, a, b in zip(("dq", "dk", "dv"), got, want):
            assert bitwise_equal(a, b), f"{name} S={seq} B={batch} {dtype} fused={fused} G={group}: " \
                                        f"max |diff| {(a.float() - b.float()).abs().max().item()}"


@pytest.mark.parametrize("seq", [200, 925])
def test_one_pass_adds_subnormals_like_the_folded_triton_kernel(seq):
    """dO at the bottom of bf16's normal range makes dS, the dQ terms and their running sums fp32
    subnormals: the TMA unit's ``.add.f32`` reductions and the Triton fold's ``add.rn.f32`` must treat
    them alike (both keep them; an ``add.rn.ftz.f32`` fold differed in 17-3722 elements on an H100)."""
    q, k, v, dout = _operands(1, seq, torch.bfloat16, False)
    dout = (dout.float() * 2.0 ** -126).to(torch.bfloat16)
    out, lse2 = at.attention_fwd(q, k, v, SCALE)
    want = _triton_fold(q, k, v, dout, out, lse2)
    got = _one_pass(q, k, v, dout, out, lse2)
    tiny = want[0].float().abs()
    assert ((tiny > 0) & (tiny < 2.0 ** -126)).any(), "no subnormal dQ: the case misses the subnormal range"
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        differ = (a.view(torch.int16) != b.view(torch.int16)).sum().item()
        assert bitwise_equal(a, b), f"{name} S={seq}: {differ} elements differ"


def test_one_pass_repeats_and_is_batch_invariant():
    q, k, v, dout = _operands(2, 4253, torch.bfloat16, False, heads=16)
    out, lse2 = at.attention_fwd(q, k, v, SCALE)
    first = _one_pass(q, k, v, dout, out, lse2)
    for _ in range(1000):
        assert all(bitwise_equal(a, b) for a, b in zip(_one_pass(q, k, v, dout, out, lse2), first)), "repeat"
    one = [t[1:2].contiguous() for t in (q, k, v, dout)]
    o1, l1 = at.attention_fwd(*one[:3], SCALE)
    alone = _one_pass(*one, o1, l1)
    assert all(bitwise_equal(a, b[1:2]) for a, b in zip(alone, first)), "sample 1 alone vs in a batch of 2"
