"""The Gluon attention forward (flowlock.ops.attention.gluon_fwd) gives the Triton forward's bits on a
Hopper GPU, with every ring depth and with and without ping-pong: ``out`` and ``lse2`` at D = 128 for
sequence lengths with a partial last KV block and query block (925, 4253, 200, 129, 257, 1), whole
blocks (4096), two samples, bf16 and fp16, and again on a repeat. The reference is the Triton forward
of the frozen tiles with ``GLUON=0``: the frozen config itself runs the Gluon kernel.

    TRITON_INTERPRET=0 python -m pytest -q -m gpu tests/ops/test_attention_gluon_fwd_gpu.py
"""

import pytest
import torch

from flowlock.config import launch_config
from flowlock.keys import arch_of
from flowlock.ops.attention import gluon_fwd
from flowlock.ops.attention import triton as at
from flowlock.testing import bitwise_equal

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                       reason="needs a Hopper (sm90) GPU"),
]


@pytest.mark.parametrize("ring, pingpong", [(3, False), (2, False), (3, True), (2, True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch, seq", [(1, 925), (1, 4253), (1, 4096), (2, 200), (1, 1), (1, 129), (1, 257)])
def test_gluon_forward_keeps_the_triton_bits(batch, seq, dtype, ring, pingpong):
    g = torch.Generator(device="cuda").manual_seed(seq + batch)
    q, k, v = (torch.randn(batch, seq, 8, 128, generator=g, device="cuda").to(dtype) for _ in range(3))
    assert all(at.tma_eligible(t) for t in (q, k, v))
    scale = 128 ** -0.5
    triton_cfg = launch_config("attention_fwd", dtype, arch_of(q), (128,)).with_blocks(GLUON=0)
    want = at.attention_fwd(q, k, v, scale, triton_cfg)
    run = lambda: gluon_fwd.attention_fwd_ws(q, k, v, scale, ring, pingpong)
    got = run()
    for name, a, b in zip(("out", "lse2"), got, want):
        assert bitwise_equal(a, b), f"{name} S={seq} B={batch} {dtype}"
    assert all(bitwise_equal(a, b) for a, b in zip(run(), got)), "repeat"
