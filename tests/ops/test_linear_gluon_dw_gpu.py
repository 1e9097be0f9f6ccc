"""The Gluon dW candidate (flowlock.ops.linear.gluon_dw, the dW config with ``GLUON``) gives the bits of
the Triton TMA kernel under the same config on a Hopper GPU: at H3's linear shapes, at token counts
that end in a partial unit (925, 4253), in whole units (2048), one unit (1024), inside one BLOCK_R step
(1, 64), as the persistent walk and one program per tile (PER_TILE), beside dX (``linear_dx_dw``), with
a zero token row, on a repeat, in bf16 and fp16.

    TRITON_INTERPRET=0 python -m pytest -q -m gpu tests/ops/test_linear_gluon_dw_gpu.py
"""

import pytest
import torch

from flowlock.ops.linear import gluon_dw
from flowlock.ops.linear import triton as lt
from flowlock.testing import bitwise_equal

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                       reason="needs a Hopper (sm90) GPU"),
]

BF16 = torch.bfloat16
SHAPES = {"q": (7168, 5376), "out": (5376, 7168), "fc1": (28672, 5376), "fc2": (5376, 14336)}
TOKENS = (925, 4253, 2048, 1024, 64, 1)
GLUON = dict(GLUON=1, RING=2)


def _operands(m, n, k, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, generator=g, device="cuda").to(dtype)
    dy = torch.randn(m, n, generator=g, device="cuda").to(dtype)
    dy[m // 2] = 0  # a zero token row: signed-zero products in every unit sum it falls in
    w = torch.empty(n, k, dtype=dtype, device="cuda")
    return x, w, dy


@pytest.mark.parametrize("name", list(SHAPES))
def test_gluon_dw_keeps_the_triton_bits(name):
    n, k = SHAPES[name]
    for m in TOKENS:
        x, w, dy = _operands(m, n, k, BF16, seed=n + k + m)
        frozen = lt.lookup("linear_dw", w, dy, x)
        for per_tile in (0, 1):
            cfg = frozen.with_blocks(PER_TILE=per_tile, **GLUON)
            assert gluon_dw.applies(cfg, dy, True, x, False, w)
            want = lt.linear_dw(dy, x, w, BF16, config=cfg.with_blocks(GLUON=0))
            got = lt.linear_dw(dy, x, w, BF16, config=cfg)
            assert bitwise_equal(got, want), f"{name} M={m} PER_TILE={per_tile}"
            assert bitwise_equal(lt.linear_dw(dy, x, w, BF16, config=cfg), got), f"{name} M={m} repeat"


def test_gluon_dw_keeps_the_triton_bits_in_fp16():
    n, k = SHAPES["out"]
    x, w, dy = _operands(925, n, k, torch.float16, seed=7)
    cfg = lt.lookup("linear_dw", w, dy, x).with_blocks(**GLUON)
    want = lt.linear_dw(dy, x, w, torch.float16, config=cfg.with_blocks(GLUON=0))
    assert bitwise_equal(lt.linear_dw(dy, x, w, torch.float16, config=cfg), want)


def test_gluon_dw_beside_dx_keeps_the_bits(monkeypatch):
    """``linear_dx_dw`` at M = 925 (dW on the side stream, one program per tile) with the dW config
    set to the Gluon kernel, against dX then the Triton dW."""
    n, k = SHAPES["q"]
    x, w, dy = _operands(925, n, k, BF16, seed=8)
    frozen = lt.lookup("linear_dw", w, dy, x)
    want_dw = lt.linear_dw(dy, x, w, BF16, config=frozen)
    want_dx = lt.linear_dx(dy, w, BF16)
    real_lookup = lt.lookup
    monkeypatch.setattr(lt, "lookup", lambda op, *a: real_lookup(op, *a).with_blocks(**GLUON)
                        if op == "linear_dw" else real_lookup(op, *a))
    dx, dw = lt.linear_dx_dw(dy, x, w, BF16, BF16)
    assert bitwise_equal(dx, want_dx) and bitwise_equal(dw, want_dw)
