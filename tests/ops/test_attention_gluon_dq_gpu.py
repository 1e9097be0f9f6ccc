"""The pipelined Gluon dQ kernel (flowlock.ops.attention.gluon_dq) gives the Triton dQ kernel's bits on a
Hopper GPU: ``attention_bwd`` with the frozen dQ config and with that config plus ``GLUON=1`` return the
same dQ, dK and dV, compared as raw bits, at sequence lengths with a partial last KV and query block
(925, 4253, 65, 1), whole blocks (4096, 64), fewer KV blocks than ring stages (200, 65, 64, 1), two
samples, views of a fused qkv projection, bf16 and fp16, and again on a repeat.

    TRITON_INTERPRET=0 python -m pytest -q -m gpu tests/ops/test_attention_gluon_dq_gpu.py
"""

import pytest
import torch

from flowlock.config import launch_config
from flowlock.ops.attention import gluon_dq
from flowlock.ops.attention import triton as at
from flowlock.testing import bitwise_equal

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                       reason="needs a Hopper (sm90) GPU"),
]

HEADS = 8


def _operands(batch, seq, dtype, fused):
    g = torch.Generator(device="cuda").manual_seed(seq + 7 * batch)
    if fused:
        qkv = torch.randn(batch, seq, 3, HEADS, 128, generator=g, device="cuda").to(dtype)
        q, k, v = qkv.unbind(2)
    else:
        q, k, v = (torch.randn(batch, seq, HEADS, 128, generator=g, device="cuda").to(dtype) for _ in range(3))
    dout = torch.randn(batch, seq, HEADS, 128, generator=g, device="cuda").to(dtype)
    return q, k, v, dout


def _gluon_config(dtype, ring=4):
    frozen = launch_config("attention_bwd_dq", dtype, "sm90", (128,))
    return frozen.with_blocks(GLUON=1, RING=ring)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch, seq, fused", [(1, 925, False), (1, 4253, True), (1, 4096, False), (2, 200, False),
                                               (1, 65, False), (1, 64, True), (1, 1, False)])
def test_gluon_dq_keeps_the_triton_bits(batch, seq, fused, dtype):
    q, k, v, dout = _operands(batch, seq, dtype, fused)
    assert all(at.tma_eligible(t) for t in (q, k, v, dout)) and gluon_dq.applies(q)
    scale = 128 ** -0.5
    out, lse2 = at.attention_fwd(q, k, v, scale)
    want = at.attention_bwd(dout, q, k, v, out, lse2, scale)
    got = at.attention_bwd(dout, q, k, v, out, lse2, scale, dq_config=_gluon_config(q.dtype))
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert bitwise_equal(a, b), f"{name} S={seq} B={batch} {dtype} fused={fused}"
    again = at.attention_bwd(dout, q, k, v, out, lse2, scale, dq_config=_gluon_config(q.dtype))
    assert all(bitwise_equal(a, b) for a, b in zip(again, got)), "repeat"


def test_gluon_dq_ring_depths_agree():
    q, k, v, dout = _operands(1, 925, torch.bfloat16, False)
    scale = 128 ** -0.5
    out, lse2 = at.attention_fwd(q, k, v, scale)
    got = [at.attention_bwd(dout, q, k, v, out, lse2, scale, dq_config=_gluon_config(q.dtype, ring))[0]
           for ring in (2, 3, 4, 5)]
    assert all(bitwise_equal(g, got[0]) for g in got[1:])
