"""The panel stream-K candidate (flowlock.ops.linear.gluon_stream: the forward config with ``GLUON`` and
``STREAM_PANELS``) gives the bits of the walk on a Hopper GPU: at the shapes and token counts where it
shares panels (out at M = 925, 897 and 1024, fc2 at 925, q at 600), with and without bias, on a
repeat through the prepared launch with new tensors, and while a GEMM on another stream holds SMs
when its programs start (they get SMs as those tiles finish; the ticket orders them, so no tail
waits for a head whose program has not started).

    TRITON_INTERPRET=0 python -m pytest -q -m gpu tests/ops/test_linear_gluon_stream_gpu.py
"""

import pytest
import torch

from flowlock.ops.linear import gluon_stream
from flowlock.ops.linear import triton as lt
from flowlock.testing import bitwise_equal

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                       reason="needs a Hopper (sm90) GPU"),
]

BF16 = torch.bfloat16
CASES = [("out", (5376, 7168), 925), ("out", (5376, 7168), 897), ("out", (5376, 7168), 1024),
         ("fc2", (5376, 14336), 925), ("q", (7168, 5376), 600)]


def _operands(m, n, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, generator=g, device="cuda").to(BF16)
    x[m // 2] = 0
    w = (torch.randn(n, k, generator=g, device="cuda") / k**0.5).to(BF16)
    bias = torch.randn(n, generator=g, device="cuda").to(BF16)
    return x, w, bias


@pytest.mark.parametrize("name, shape, m", CASES)
def test_panel_stream_keeps_the_walks_bits(name, shape, m):
    n, k = shape
    x, w, bias = _operands(m, n, k, seed=n + m)
    walk = lt.lookup("linear_fwd", w, x, w)
    stream = walk.with_blocks(STREAM_PANELS=1)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert gluon_stream.applies(stream, x, False, w, True, torch.empty(m, n, dtype=BF16, device="cuda"), sms)
    for b in (None, bias):
        want = lt.linear_fwd(x, w, b, BF16, config=walk)
        got = lt.linear_fwd(x, w, b, BF16, config=stream)
        assert bitwise_equal(got, want), f"{name} M={m} bias={b is not None}"
        plans = gluon_stream.prepared_launches()
        again = lt.linear_fwd(x.clone(), w.clone(), None if b is None else b.clone(), BF16, config=stream)
        assert gluon_stream.prepared_launches() == plans, "the repeat takes the prepared launch"
        assert bitwise_equal(again, got), f"{name} M={m} repeat"
        assert bitwise_equal(want, lt.linear_fwd(x, w, b, BF16, config=walk.with_blocks(GLUON=0))), "Triton walk"


def test_panel_stream_repeats_beside_other_work():
    n, k = 5376, 7168
    x, w, bias = _operands(925, n, k, seed=3)
    walk = lt.lookup("linear_fwd", w, x, w)
    want = lt.linear_fwd(x, w, bias, BF16, config=walk)
    bx, bw, _ = _operands(4253, n, k, seed=4)
    bdy = torch.randn(4253, n, device="cuda").to(BF16)
    busy = lt.lookup("linear_dw", bw, bdy, bx).with_blocks(PER_TILE=1)
    main, side = torch.cuda.current_stream(), torch.cuda.Stream()
    for round_ in range(3):
        side.wait_stream(main)
        with torch.cuda.stream(side):
            lt.linear_dw(bdy, bx, bw, BF16, config=busy)
        if round_ == 2:
            torch.cuda._sleep(20_000_000)
        got = lt.linear_fwd(x, w, bias, BF16, config=walk.with_blocks(STREAM_PANELS=1))
        main.wait_stream(side)
        assert bitwise_equal(got, want), f"round {round_}"
