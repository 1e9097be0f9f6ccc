"""The warp-specialized Gluon forward (flowlock.ops.linear.gluon, a candidate) gives the bits of the frozen
Triton forward on a Hopper GPU at H3's linear shapes, at token counts whose last tile is partial, and
again on a repeat.

    TRITON_INTERPRET=0 python -m pytest -q -m gpu tests/ops/test_linear_gluon_gpu.py
"""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                       reason="needs a Hopper (sm90) GPU"),
]

BF16 = torch.bfloat16
SHAPES = {"q": (7168, 5376), "out": (5376, 7168), "fc1": (28672, 5376), "fc2": (5376, 14336)}


@pytest.mark.parametrize("name", list(SHAPES))
def test_gluon_forward_keeps_the_triton_bits(name):
    from flowlock.ops.linear import gluon as lg
    from flowlock.ops.linear import triton as lt

    n, k = SHAPES[name]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = (torch.randn(n, k, generator=g, device="cuda") / k**0.5).to(BF16)
    for m in (925, 4253, 64, 1):
        x = torch.randn(m, k, generator=g, device="cuda").to(BF16)
        x[m // 2] = 0  # a zero row: its products are signed zeros, whose sum's sign follows the accumulator rule
        want = lt.linear_fwd(x, w, None, BF16)
        got = lg.linear_fwd_ws(x, w, sms)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"{name} M={m}"
        again = lg.linear_fwd_ws(x, w, sms)
        assert torch.equal(again.view(torch.int16), got.view(torch.int16)), f"{name} M={m} repeat"
