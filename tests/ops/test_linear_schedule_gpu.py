"""How linear's tiles are scheduled moves no arithmetic, on a Hopper GPU at H3's shapes: the frozen
configs (TAIL_SPLIT: the walk's partial last round as half-width tiles) and the same with STREAM_K (the
sweep candidate sharing one round plus a short tail out, cut tiles' fp32 accumulators handed on) give
the bits of the same configs walking whole tiles, rows keep their bits across token counts whose walks
split differently, and dW on a side stream beside dX (``linear_dx_dw``, PER_TILE) gives the bits of the
two run one by one.

    TRITON_INTERPRET=0 python -m pytest -q -m gpu tests/ops/test_linear_schedule_gpu.py
"""


import pytest
import torch

from flowlock.ops.linear import triton as lt

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                       reason="needs a Hopper (sm90+) GPU"),
]

BF16 = torch.bfloat16
# (N, K) of H3's linear weights: q (k, v alike), out, fc1, fc2 and the fused qkv.
SHAPES = {"q": (7168, 5376), "out": (5376, 7168), "fc1": (28672, 5376), "fc2": (5376, 14336), "qkv": (21504, 5376)}
# 925: dX of q and fc1 is 168 tiles (tail 36, split; stream-K with STREAM_K), the forward of q 224; 4253: 714
# tiles (tail 54, split);
# 64: one row of tiles, fewer tiles than SMs (every tile split where the halves fit one round).
TOKENS = (925, 4253, 64)
SCHEDULES = ("frozen", "stream_k", "whole")


def _operands(m, n, k, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, generator=g, device="cuda").to(BF16)
    w = (torch.randn(n, k, generator=g, device="cuda") / k**0.5).to(BF16)
    dy = torch.randn(m, n, generator=g, device="cuda").to(BF16)
    return x, w, dy


def _products(x, w, dy, schedule: str = "frozen"):
    """Forward, dX and dW with the frozen configs, those with STREAM_K on the Triton kernel (``stream_k``;
    dW has token units, so it keeps the walk), or those without TAIL_SPLIT (``whole``: the walk over whole tiles)."""
    cfgs = {op: lt.lookup(op, w, *ops) for op, ops in
            (("linear_fwd", (x, w)), ("linear_dx", (dy, w)), ("linear_dw", (dy, x)))}
    assert all(dict(c.blocks).get("TAIL_SPLIT") for c in cfgs.values()), "the sm90 configs split the tail"
    if schedule == "stream_k":
        cfgs = {op: c.with_blocks(STREAM_K=1, GLUON=0) for op, c in cfgs.items()}  # stream-K is the Triton kernel's
    elif schedule == "whole":
        cfgs = {op: c.with_blocks(TAIL_SPLIT=0) for op, c in cfgs.items()}
    return (lt.linear_fwd(x, w, None, BF16, config=cfgs["linear_fwd"]),
            lt.linear_dx(dy, w, BF16, config=cfgs["linear_dx"]),
            lt.linear_dw(dy, x, w, BF16, config=cfgs["linear_dw"]))


def _same_bits(a, b):
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("name", list(SHAPES))
def test_stream_k_and_split_tail_keep_the_bits(name):
    n, k = SHAPES[name]
    for m in TOKENS + (16384,):
        x, w, dy = _operands(m, n, k)
        whole = _products(x, w, dy, "whole")
        for schedule in SCHEDULES[:2]:
            for product, a, b in zip(("forward", "dX", "dW"), _products(x, w, dy, schedule), whole):
                assert _same_bits(a, b), f"{name} M={m} {product}: {schedule} differs from whole tiles"


@pytest.mark.parametrize("name", ["q", "fc2"])
def test_stream_k_repeats_beside_other_work(name):
    """With STREAM_K, the same bits on every call, also when the launch's programs start while a GEMM
    on another stream holds the SMs (they get SMs as its tiles finish; the ticket orders them, so none
    waits for a head whose program has not started) and when it queues behind a long kernel."""
    n, k = SHAPES[name]
    x, w, dy = _operands(925, n, k, seed=3)
    want = _products(x, w, dy, "whole")
    bx, bw, bdy = _operands(4253, n, k, seed=4)
    busy_cfg = lt.lookup("linear_dw", bw, bdy, bx).with_blocks(PER_TILE=1)
    main, side = torch.cuda.current_stream(), torch.cuda.Stream()
    for round_ in range(3):
        side.wait_stream(main)
        with torch.cuda.stream(side):
            lt.linear_dw(bdy, bx, bw, BF16, config=busy_cfg)
        if round_ == 2:
            torch.cuda._sleep(20_000_000)
        got = _products(x, w, dy, "stream_k")
        main.wait_stream(side)
        for product, a, b in zip(("forward", "dX", "dW"), got, want):
            assert _same_bits(a, b), f"{name} round {round_} {product}"


@pytest.mark.parametrize("name", ["q", "fc1"])
def test_rows_keep_their_bits_across_token_counts(name):
    """The first 925 rows of a 4253-row product (the walk of 714 tiles, tail split) equal the 925-row
    product (168 tiles, tail split, or stream-K), in the forward and in dX."""
    n, k = SHAPES[name]
    x, w, dy = _operands(4253, n, k, seed=1)
    big = _products(x, w, dy)
    small = _products(x[:925], w, dy[:925], "stream_k")
    assert torch.equal(big[0][:925], small[0]), f"{name} forward rows"
    assert torch.equal(big[1][:925], small[1]), f"{name} dX rows"


@pytest.mark.parametrize("name", ["q", "out", "fc1", "fc2"])
def test_dw_beside_dx_keeps_the_bits(name):
    """``linear_dx_dw`` (dW on a side stream, one program per tile, at M = 925; dX then the persistent
    dW at M = 4253, where dX is more rounds of the SMs) against dX then dW on the current stream, dW as
    the persistent walk; also behind a busy current stream, whose pending work the side stream must
    wait for (the inputs are written there just before)."""
    n, k = SHAPES[name]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for m in (925, 4253):
        x, w, dy = _operands(m, n, k, seed=2)
        cfg = lt.lookup("linear_dw", w, dy, x)
        assert dict(cfg.blocks).get("PER_TILE"), "the sm90 dW config runs beside dX"
        dx_cfg = lt.lookup("linear_dx", w, dy, w)
        dx_tiles = -(-m // dx_cfg["BLOCK_I"]) * -(-k // dx_cfg["BLOCK_J"])
        assert lt.runs_beside(dx_tiles, sms) == (m == 925), f"{name} M={m}: {dx_tiles} dX tiles on {sms} SMs"
        dx_alone = lt.linear_dx(dy, w, BF16)
        dw_alone = lt.linear_dw(dy, x, w, BF16, config=cfg.with_blocks(PER_TILE=0))
        dx, dw = lt.linear_dx_dw(dy, x, w, BF16, BF16)
        assert torch.equal(dx, dx_alone) and torch.equal(dw, dw_alone), f"{name} M={m}"
        dy2 = torch.empty_like(dy)
        torch.cuda._sleep(50_000_000)
        dy2.copy_(dy)
        dx2, dw2 = lt.linear_dx_dw(dy2, x, w, BF16, BF16)
        assert torch.equal(dx2, dx_alone) and torch.equal(dw2, dw_alone), f"{name} M={m} behind a busy stream"
