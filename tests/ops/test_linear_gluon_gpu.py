"""The warp-specialized Gluon GEMM (flowlock.ops.linear.gluon, a config's ``GLUON``) gives the bits of the
Triton TMA kernel under the same config on a Hopper GPU: the forward with and without bias and dX, at
H3's linear shapes, at token counts whose walks split their last round into half-width tiles (925,
4253, 64: every tile split), one row, and again on a repeat (through the prepared launch); in bf16
and fp16; with the frozen tile and with 256-wide tiles where the frozen forward is 128 wide.

    TRITON_INTERPRET=0 python -m pytest -q -m gpu tests/ops/test_linear_gluon_gpu.py
"""

import pytest
import torch

from flowlock.ops.linear import gluon as lg
from flowlock.ops.linear import triton as lt
from flowlock.testing import bitwise_equal

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                       reason="needs a Hopper (sm90) GPU"),
]

BF16 = torch.bfloat16
SHAPES = {"q": (7168, 5376), "out": (5376, 7168), "fc1": (28672, 5376), "fc2": (5376, 14336), "qkv": (21504, 5376)}
TOKENS = (925, 4253, 64, 1)
VARIANTS = {"frozen_tile": dict(GLUON=1, RING=3), "wide": dict(GLUON=1, RING=3, BLOCK_J=256, EPI_SPLIT=1)}


def _operands(m, n, k, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, generator=g, device="cuda").to(dtype)
    x[m // 2] = 0  # a zero row: its products are signed zeros, whose sum's sign follows the accumulator rule
    w = (torch.randn(n, k, generator=g, device="cuda") / k**0.5).to(dtype)
    dy = torch.randn(m, n, generator=g, device="cuda").to(dtype)
    bias = torch.randn(n, generator=g, device="cuda").to(dtype)
    return x, w, dy, bias


def _check(name, variant, dtype, tokens):
    n, k = SHAPES[name]
    for m in tokens:
        x, w, dy, bias = _operands(m, n, k, dtype, seed=n + k + m)
        fwd = lt.lookup("linear_fwd", w, x, w)
        dx = lt.lookup("linear_dx", w, dy, w)
        ws_fwd, ws_dx = fwd.with_blocks(**VARIANTS[variant]), dx.with_blocks(**VARIANTS[variant])
        assert lg.applies(ws_fwd, x, False, w, x) and lg.applies(ws_dx, dy, False, w, dy)
        for b in (None, bias):
            want = lt.linear_fwd(x, w, b, dtype, config=ws_fwd.with_blocks(GLUON=0))
            got = lt.linear_fwd(x, w, b, dtype, config=ws_fwd)
            assert bitwise_equal(got, want), f"{name} {variant} M={m} forward bias={b is not None}"
            assert bitwise_equal(lt.linear_fwd(x, w, b, dtype, config=ws_fwd), got), f"{name} M={m} forward repeat"
        want = lt.linear_dx(dy, w, dtype, config=ws_dx.with_blocks(GLUON=0))
        got = lt.linear_dx(dy, w, dtype, config=ws_dx)
        assert bitwise_equal(got, want), f"{name} {variant} M={m} dX"
        assert bitwise_equal(lt.linear_dx(dy, w, dtype, config=ws_dx), got), f"{name} M={m} dX repeat"
        assert lg.prepared_launches() > 0, "repeats relaunch the prepared Gluon launch"


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("name", list(SHAPES))
def test_gluon_keeps_the_triton_bits(name, variant):
    _check(name, variant, BF16, TOKENS)


def test_gluon_keeps_the_triton_bits_in_fp16():
    _check("out", "wide", torch.float16, (925, 1))


def test_gluon_rejects_a_ring_that_does_not_fit_before_launching():
    x, w, _, _ = _operands(64, 5376, 7168, BF16, seed=0)
    cfg = lt.lookup("linear_fwd", w, x, w).with_blocks(GLUON=1, RING=4, BLOCK_J=256)
    with pytest.raises(ValueError, match="shared memory"):
        lt.linear_fwd(x, w, None, BF16, config=cfg)


def test_gluon_relaunch_with_new_tensors_keeps_the_bits():
    """The prepared launch with new tensors at new addresses (the first ones still alive), then the
    first weight with new activations, against the Triton kernel."""
    n, k = SHAPES["q"]
    first = _operands(925, n, k, BF16, seed=5)
    second = _operands(925, n, k, BF16, seed=6)
    cfg = lt.lookup("linear_fwd", first[1], first[0], first[1])
    dx_cfg = lt.lookup("linear_dx", first[1], first[2], first[1])
    assert lg.applies(cfg, first[0], False, first[1], first[0]), "the frozen sm90 bf16 forward runs on Gluon"
    lg._PLANS.clear()
    lt.linear_fwd(first[0], first[1], first[3], BF16)
    lt.linear_dx(first[2], first[1], BF16)
    assert lg.prepared_launches() == 2
    for x, w, dy, bias in (second, (second[0], first[1], second[2], first[3])):
        got = lt.linear_fwd(x, w, bias, BF16)
        want = lt.linear_fwd(x, w, bias, BF16, config=cfg.with_blocks(GLUON=0))
        assert bitwise_equal(got, want), "forward relaunch"
        got = lt.linear_dx(dy, w, BF16)
        want = lt.linear_dx(dy, w, BF16, config=dx_cfg.with_blocks(GLUON=0))
        assert bitwise_equal(got, want), "dX relaunch"
    assert lg.prepared_launches() == 2, "no new plans: the relaunches took the prepared ones"
