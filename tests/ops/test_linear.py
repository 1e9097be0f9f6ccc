"""flowlock.ops.linear: accuracy against the FP64 golden, bitwise invariance (M, fusion, repeats),
the dW token-unit fold, config invariants and input validation. Triton runs under the interpreter."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import flowlock
from flowlock.config import _CONFIGS, launch_config
from flowlock.ops.linear import linear, linear_golden, linear_reference
from flowlock.ops.linear import triton as lt
from flowlock.testing import (
    assert_batch_invariant,
    assert_bitwise_equal,
    assert_repeatable,
    assert_within_budget,
    batch_invariance_failures,
    bitwise_equal,
    repeat_failures,
)

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _data(m, n, k, dtype, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, w, b


def _triton(*args, **kwargs):
    with flowlock.use_backend("triton"):
        return linear(*args, **kwargs)


def _grads(fn, x, w, b, dy):
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None for t in (x, w, b)]
    out = fn(*leaves)
    live = [t for t in leaves if t is not None]
    return (out, *torch.autograd.grad(out, live, dy.to(out.dtype)))


def _tma_cfg(op, dtype):
    """The interpreter-sized config with the TMA (persistent, descriptor) variant switched on."""
    return launch_config(op, dtype, "interp").with_blocks(TMA=1, EPI_SPLIT=1 if op == "linear_fwd" else 0, TAIL_SPLIT=1)


@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
@pytest.mark.parametrize("m", [1, 7, 33])
@pytest.mark.parametrize("n,k", [(24, 48), (40, 80)])
def test_forward_and_grads_within_budget(dtype, m, n, k):
    x, w, b = _data(m, n, k, dtype, seed=m + n, bias=(m != 7))
    dy = torch.randn(m, n, generator=torch.Generator().manual_seed(1))
    got = _grads(_triton, x, w, b, dy)
    gold = _grads(linear_golden, x.double(), w.double(), None if b is None else b.double(), dy.double())
    eager = _grads(F.linear, x, w, b, dy)
    for name, a, g, e in zip(("out", "dx", "dw", "db"), got, gold, eager):
        assert a.dtype == dtype
        assert_within_budget(a, g, baseline=e, out_dtype=dtype, what=f"{name} m={m} {dtype}")


def test_bf16_fp32_output_and_bias_rounding():
    x, w, b = _data(33, 40, 80, BF16, seed=3)
    out = _triton(x, w, b, out_dtype=FP32)
    assert out.dtype == FP32
    assert_within_budget(out, linear_golden(x, w, b, FP32), baseline=F.linear(x.float(), w.float(), b.float()),
                         what="bf16 in, fp32 out")
    assert_bitwise_equal(_triton(x, w, b), out.to(BF16), "bf16 output is the fp32 accumulator rounded once")


def test_fp32_path_is_true_fp32():
    x, w, b = _data(33, 40, 80, FP32, seed=4)
    gold = linear_golden(x, w, b, torch.float64)
    rel = (_triton(x, w, b).double() - gold).abs().max().item() / gold.abs().max().item()
    assert rel < 1e-6, f"relative error {rel:.2e}: TF32 would be ~1e-3"


def test_leading_dims_and_reference_backend():
    x, w, b = _data(21, 24, 48, BF16, seed=5)
    assert_bitwise_equal(_triton(x.reshape(3, 7, 48), w, b), _triton(x, w, b).reshape(3, 7, 24), "leading dims")
    assert_bitwise_equal(linear(x, w, b), linear_reference(x, w, b), "CPU dispatch goes to the reference")


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_empty_rows(backend):
    x, w, b = _data(0, 24, 48, BF16)
    x = x.reshape(2, 0, 48).requires_grad_(True)
    w.requires_grad_(True)
    with flowlock.use_backend(backend):
        out = linear(x, w, b)
    assert out.shape == (2, 0, 24) and out.dtype == BF16
    dx, dw = torch.autograd.grad(out, (x, w), torch.zeros_like(out))
    assert dx.shape == x.shape and bitwise_equal(dw, torch.zeros_like(w))


@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
def test_fused_columns_equal_separate(dtype):
    x, w, b = _data(33, 40, 80, dtype, seed=6)
    parts = [(w[:8], b[:8]), (w[8:24], b[8:24]), (w[24:], b[24:])]
    fused = _triton(x, w, b)
    cols = torch.cat([_triton(x, wp.contiguous(), bp.contiguous()) for wp, bp in parts], dim=1)
    assert_bitwise_equal(fused, cols, "fused qkv vs separate q, k, v")
    perm = torch.cat([torch.arange(20, 40), torch.arange(0, 20)])
    assert_bitwise_equal(_triton(x, w[perm].contiguous(), b[perm].contiguous()), fused[:, perm], "swapped halves")


@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_batch_invariance(backend, dtype):
    x, w, b = _data(16 * 3, 40, 80, dtype, seed=7)
    pool = x.reshape(16, 3, 80)

    def fn(xb):
        with flowlock.use_backend(backend):
            return linear(xb, w, b)

    assert_batch_invariant(fn, pool)


def _planted_split_k(xb, w, b):
    """Non-invariant on purpose: the K split point depends on the batch size and partial sums are
    rounded to bf16, as a batch-dependent split-K would."""
    cut = 16 * (1 + xb.shape[0] % 4)
    lo = (xb[..., :cut].float() @ w[:, :cut].float().T).to(BF16)
    hi = (xb[..., cut:].float() @ w[:, cut:].float().T).to(BF16)
    return (lo.float() + hi.float() + b.float()).to(BF16)


def test_batch_harness_catches_planted_split_k():
    x, w, b = _data(16 * 3, 40, 80, BF16, seed=7)
    assert batch_invariance_failures(lambda xb: _planted_split_k(xb, w, b), x.reshape(16, 3, 80))


def test_repeatable_forward_and_grads():
    x, w, b = _data(33, 40, 80, BF16, seed=8)
    dy = torch.randn(33, 40, generator=torch.Generator().manual_seed(2))
    assert_repeatable(lambda: _grads(_triton, x, w, b, dy), runs=4)


def test_repeat_harness_catches_shuffled_fold():
    x, w, _ = _data(33, 40, 80, BF16, seed=8)
    chunks = list(torch.split(torch.arange(80), 16))
    gen = torch.Generator().manual_seed(0)

    def shuffled():
        acc = torch.zeros(33, 40, dtype=BF16)
        for i in torch.randperm(len(chunks), generator=gen).tolist():
            c = chunks[i]
            acc = acc + (x[:, c].float() @ w[:, c].float().T).to(BF16)
        return acc

    assert repeat_failures(shuffled, runs=6)


@settings(max_examples=12, deadline=None)
@given(m=st.integers(1, 40), n=st.integers(1, 40), k=st.integers(1, 70), split=st.integers(0, 40),
       rows=st.lists(st.integers(0, 39), min_size=1, max_size=5), seed=st.integers(0, 2**16))
def test_hypothesis_fusion_and_row_invariance(m, n, k, split, rows, seed):
    x, w, b = _data(m, n, k, BF16, seed=seed)
    full = _triton(x, w, b)
    split = min(split, n - 1)
    if split > 0:
        halves = [_triton(x, w[s].contiguous(), b[s].contiguous()) for s in (slice(0, split), slice(split, n))]
        assert_bitwise_equal(full, torch.cat(halves, dim=1), "column split")
    rows = torch.tensor([r % m for r in rows])
    assert_bitwise_equal(_triton(x[rows], w, b), full[rows], "row subset vs full batch")


@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
def test_tma_variant_under_interpreter(dtype):
    """The persistent descriptor kernel (the Hopper variant) has the same semantics."""
    x, w, b = _data(33, 40, 80, dtype, seed=9)
    dy = torch.randn(33, 40, generator=torch.Generator().manual_seed(3)).to(dtype)
    out = lt.linear_fwd(x, w, b, dtype, config=_tma_cfg("linear_fwd", dtype))
    dx = lt.linear_dx(dy, w, dtype, config=_tma_cfg("linear_dx", dtype))
    dw = lt.linear_dw(dy, x, w, dtype, config=_tma_cfg("linear_dw", dtype))
    gold = _grads(linear_golden, x.double(), w.double(), b.double(), dy.double())
    eager = _grads(F.linear, x, w, b, dy)
    for name, a, g, e in zip(("out", "dx", "dw"), (out, dx, dw), gold, eager):
        assert_within_budget(a, g, baseline=e, out_dtype=dtype, what=f"tma {name}")
    alone = lt.linear_fwd(x[5:6], w, b, dtype, config=_tma_cfg("linear_fwd", dtype))
    assert_bitwise_equal(alone, out[5:6], "tma row alone vs in batch")
    cols = lt.linear_fwd(x, w[16:].contiguous(), b[16:].contiguous(), dtype, config=_tma_cfg("linear_fwd", dtype))
    assert_bitwise_equal(cols, out[:, 16:], "tma column shard")


@pytest.mark.parametrize("op", ["linear_fwd", "linear_dx", "linear_dw"])
@pytest.mark.parametrize(("rows", "cols"), [(56, 56), (64, 16), (16, 16), (48, 48), (56, 24)])
def test_tma_tail_split_moves_no_arithmetic(op, rows, cols):
    """Half-width tiles for the walk's last round, and one program per tile (PER_TILE), give every
    element the bits of the walk over whole tiles.

    The output is rows x cols in 16 x 16 tiles walked by 3 programs under the interpreter: 16 tiles
    (tail 1: split, and the last column tile's right half lies past cols), 4 (tail 1, split), 1 (fewer
    tiles than programs: both halves run), 9 (no tail) and 8 (tail 2: halves would not fit a round).
    """
    g = torch.Generator().manual_seed(12)
    a80, a40 = torch.randn(rows, 80, generator=g).to(BF16), torch.randn(40, rows, generator=g).to(BF16)
    b80, b40 = torch.randn(cols, 80, generator=g).to(BF16), torch.randn(40, cols, generator=g).to(BF16)
    bias = torch.randn(cols, generator=g).to(BF16)
    runs = {"linear_fwd": lambda c: lt.linear_fwd(a80, b80, bias, BF16, config=c),
            "linear_dx": lambda c: lt.linear_dx(a80, b80.T.contiguous(), BF16, config=c),
            "linear_dw": lambda c: lt.linear_dw(a40, b40, torch.empty(rows, cols, dtype=BF16), FP32, config=c)}
    cfg = _tma_cfg(op, BF16)
    whole = runs[op](cfg.with_blocks(TAIL_SPLIT=0))
    assert whole.shape == (rows, cols)
    assert_bitwise_equal(runs[op](cfg), whole, f"{op} split tail vs whole tiles")
    assert_bitwise_equal(runs[op](cfg.with_blocks(PER_TILE=1)), whole, f"{op} one TMA program per tile vs the walk")
    assert_bitwise_equal(runs[op](cfg.with_blocks(TMA=0)), whole, f"{op} TMA walk vs the pointer kernel")


@pytest.mark.parametrize("op", ["linear_fwd", "linear_dx"])
@pytest.mark.parametrize(("rows", "cols", "k"), [(32, 32, 80), (64, 16, 200), (16, 64, 48), (56, 56, 80)])
def test_tma_stream_k_moves_no_arithmetic(op, rows, cols, k):
    """Sharing the tiles out stream-K, a cut tile's chain continued by the next program from the fp32
    accumulator its head left, gives every element the bits of the walk over whole tiles.

    3 programs under the interpreter, 16 x 16 tiles: 4 tiles, one round plus a tail of one, in three
    runs of 4/3 tiles, so two tiles are cut (K = 80 is 3 steps of the forward's BLOCK_R and 5 of dX's;
    K = 200 cuts long chains part-way; K = 48 is 2 and 3 steps); and 16 tiles, where the launcher keeps
    the walk.
    """
    g = torch.Generator().manual_seed(21)
    a = torch.randn(rows, k, generator=g).to(BF16)
    b = torch.randn(cols, k, generator=g).to(BF16)
    bias = torch.randn(cols, generator=g).to(BF16)
    runs = {"linear_fwd": lambda c: lt.linear_fwd(a, b, bias, BF16, config=c),
            "linear_dx": lambda c: lt.linear_dx(a, b.T.contiguous(), BF16, config=c)}
    cfg = _tma_cfg(op, BF16).with_blocks(STREAM_K=1)
    tiles = -(-rows // cfg["BLOCK_I"]) * -(-cols // cfg["BLOCK_J"])
    assert lt.streams_k(True, cfg["UNIT"], False, tiles, lt._INTERP_PROGRAMS) == (tiles == 4)
    whole = runs[op](cfg.with_blocks(STREAM_K=0, TAIL_SPLIT=0))
    assert_bitwise_equal(runs[op](cfg), whole, f"{op} {rows}x{cols} K={k}: stream-K vs whole tiles")
    assert_bitwise_equal(runs[op](cfg.with_blocks(STREAM_K=0)), whole, f"{op} {rows}x{cols}: split tail vs whole tiles")


def test_stream_k_tail_waits_for_its_head(monkeypatch):
    """A program continues a cut tile only once the previous program's head is published: start the
    ticket at 1, so the first program to run holds a tail whose head no program has computed, and the
    interpreted wait reports the turn as out of order instead of continuing from a stale accumulator."""
    a = torch.randn(32, 80, generator=torch.Generator().manual_seed(4)).to(BF16)
    b = torch.randn(32, 80, generator=torch.Generator().manual_seed(5)).to(BF16)
    workspace = lt._chain_workspace

    def ticket_from_one(c, programs, cfg):
        chain, turns = workspace(c, programs, cfg)
        turns[0] = 1
        return chain, turns

    monkeypatch.setattr(lt, "_chain_workspace", ticket_from_one)
    with pytest.raises(Exception, match="turn taken out of order"):  # the interpreter wraps the RuntimeError
        lt.linear_fwd(a, b, None, BF16, config=_tma_cfg("linear_fwd", BF16).with_blocks(STREAM_K=1))


def test_stream_k_only_for_one_chain_and_one_round_plus_half():
    """Stream-K needs one accumulation chain per element (no dW token units, no compensation term) and
    one round of the programs plus a tail of at most half a round (on 132 SMs: 133-198 tiles; dX of q
    and fc1 at M = 925 is 168); it is a sweep candidate, which no frozen sm90 config sets."""
    assert lt.streams_k(True, 0, False, 168, 132)
    assert lt.streams_k(True, 0, False, 133, 132) and lt.streams_k(True, 0, False, 198, 132)
    assert not lt.streams_k(True, 0, False, 199, 132) and not lt.streams_k(True, 0, False, 224, 132)
    assert not lt.streams_k(True, 0, False, 132, 132) and not lt.streams_k(True, 0, False, 100, 132)
    assert not lt.streams_k(True, 0, False, 714, 132)
    assert not lt.streams_k(False, 0, False, 168, 132)
    assert not lt.streams_k(True, 1024, False, 168, 132)
    assert not lt.streams_k(True, 0, True, 168, 132)
    for dt in (BF16, FP16, FP32):
        for op in ("linear_fwd", "linear_dx", "linear_dw"):
            assert dict(launch_config(op, dt, "sm90").blocks).get("STREAM_K", 0) == 0


def test_dw_beside_dx_only_while_dx_is_few_rounds():
    """On an H200 (132 SMs), H3's backward linears run dW beside dX at M = 925 (dX of q, out, fc1,
    fc2: 168-448 tiles of the frozen sm90 dX tile) and one after the other, dW as the persistent walk,
    at M = 4253 and 16384; the walk is the PER_TILE config with only that key switched off."""
    dx_cfg = launch_config("linear_dx", BF16, "sm90")
    dw_cfg = launch_config("linear_dw", BF16, "sm90")
    assert dw_cfg["PER_TILE"] == 1
    for k in (5376, 7168, 14336):  # dX widths: q / k / v and fc1, out, fc2
        tiles = {m: -(-m // dx_cfg["BLOCK_I"]) * -(-k // dx_cfg["BLOCK_J"]) for m in (925, 4253, 16384)}
        assert lt.runs_beside(tiles[925], 132), (k, tiles)
        assert not lt.runs_beside(tiles[4253], 132) and not lt.runs_beside(tiles[16384], 132), (k, tiles)
    walking = lt._walking(dw_cfg)
    assert walking["PER_TILE"] == 0
    assert {k: v for k, v in walking.blocks if k != "PER_TILE"} == {k: v for k, v in dw_cfg.blocks if k != "PER_TILE"}
    assert (walking.num_warps, walking.num_stages) == (dw_cfg.num_warps, dw_cfg.num_stages)


@pytest.mark.parametrize("variant", ["pointer", "tma", "tma_flat"])
def test_dw_token_unit_fold_reproduces_from_unit_partials(variant):
    """SP readiness: per-unit fp32 partials computed on row slices, folded left, equal the full dW."""
    cfg = launch_config("linear_dw", BF16, "interp")
    if variant != "pointer":
        cfg = _tma_cfg("linear_dw", BF16).with_blocks(FLAT_UNITS=int(variant == "tma_flat"))
    unit = cfg["UNIT"]
    m = 2 * unit + 9
    x, w, _ = _data(m, 40, 80, BF16, seed=10)
    dy = torch.randn(m, 40, generator=torch.Generator().manual_seed(4)).to(BF16)
    full = lt.linear_dw(dy, x, w, FP32, config=cfg)
    folded = torch.zeros_like(full)
    for s in range(0, m, unit):
        folded = folded + lt.linear_dw(dy[s:s + unit], x[s:s + unit], w, FP32, config=cfg)
    assert_bitwise_equal(full, folded, "dW vs left fold of unit partials")
    if variant == "tma_flat":
        nested = lt.linear_dw(dy, x, w, FP32, config=cfg.with_blocks(FLAT_UNITS=0))
        assert_bitwise_equal(full, nested, "flat unit loop vs nested unit loop")
    assert_bitwise_equal(lt.linear_dw(dy, x, w, BF16, config=cfg), full.to(BF16), "dW rounds the fp32 fold once")

    db_cfg = launch_config("linear_dbias", BF16, "interp")
    db = lt.linear_dbias(dy, w, FP32, config=db_cfg)
    db_folded = torch.zeros_like(db)
    for s in range(0, m, db_cfg["UNIT"]):
        db_folded = db_folded + lt.linear_dbias(dy[s:s + db_cfg["UNIT"]], w, FP32, config=db_cfg)
    assert_bitwise_equal(db, db_folded, "dBias vs left fold of unit partials")


def test_mixed_fp32_grad_into_bf16_weights():
    """bf16 weights with an fp32 output: the fp32 upstream gradient is used unrounded."""
    x, w, b = _data(7, 24, 48, BF16, seed=11)
    dy = torch.randn(7, 24, generator=torch.Generator().manual_seed(5))
    got = _grads(lambda *a: _triton(*a, out_dtype=FP32), x, w, b, dy)
    gold = _grads(lambda *a: linear_golden(*a, out_dtype=FP32), x.double(), w.double(), b.double(), dy.double())
    eager = _grads(lambda xx, ww, bb: F.linear(xx.float(), ww.float(), bb.float()), x, w, b, dy)
    for name, a, g, e in zip(("out", "dx", "dw", "db"), got, gold, eager):
        assert_within_budget(a.double(), g, baseline=e, out_dtype=a.dtype, what=f"mixed {name}")


def test_config_reduction_order_independent_of_shape():
    """BLOCK_R, UNIT and the kernel variant are one value per (op, dtype, arch): never N- or M-keyed."""
    seen: dict[tuple[str, str, str], tuple[int, int, int]] = {}
    for (op, dtype, arch, _shape), cfg in _CONFIGS.items():
        if op in ("linear_fwd", "linear_dx", "linear_dw"):
            key = (cfg["BLOCK_R"], cfg["UNIT"], cfg["TMA"])
            assert seen.setdefault((op, dtype, arch), key) == key, f"{op} {dtype} {arch} varies with shape"
    dw_units = {arch: cfg["UNIT"] for (op, _, arch, _), cfg in _CONFIGS.items() if op == "linear_dw"}
    db_units = {arch: cfg["UNIT"] for (op, _, arch, _), cfg in _CONFIGS.items() if op == "linear_dbias"}
    assert dw_units == db_units, "dW and dBias share the token unit"
    for (op, _, _, _), cfg in _CONFIGS.items():
        if op == "linear_dw":
            assert cfg["UNIT"] % cfg["BLOCK_R"] == 0


def test_tma_alignment_rule():
    assert lt.tma_alignment_error(torch.empty(21504, 5376, dtype=BF16), (BF16,)) is None
    assert "multiples of 8" in lt.tma_alignment_error(torch.empty(40, 84, dtype=BF16), (BF16,))


def _bad_calls():
    x, w, b = _data(7, 24, 48, BF16)
    xf, wf, bf = _data(7, 24, 48, FP32)
    wide = torch.zeros(24, 96, dtype=BF16)
    return [
        ("x", TypeError, (x.double(), w.double(), None), {}),
        ("weight", TypeError, (x, w.half(), None), {}),
        ("x", TypeError, ([1.0], w, None), {}),
        ("weight", TypeError, (x, wf, None), {}),
        ("weight", ValueError, (x, w[0], None), {}),
        ("weight", ValueError, (x, wide[:, ::2], None), {}),
        ("weight", ValueError, (x, w[:0], None), {}),
        ("x", ValueError, (x[:, :40], w, None), {}),
        ("x", ValueError, (torch.zeros(7, 96, dtype=BF16)[:, ::2], w, None), {}),
        ("bias", ValueError, (x, w, b[:20]), {}),
        ("bias", TypeError, (x, w, bf), {}),
        ("bias", ValueError, (x, w, torch.zeros(48, dtype=BF16)[::2]), {}),
        ("out_dtype", ValueError, (x, w, b), {"out_dtype": torch.float16}),
        ("out_dtype", ValueError, (x.half(), w.half(), b.half()), {"out_dtype": BF16}),
        ("out_dtype", ValueError, (xf, wf, bf), {"out_dtype": BF16}),
        ("out_dtype", TypeError, (x, w, b), {"out_dtype": "bf16"}),
        ("weight", ValueError, (x, w.to("meta"), None), {}),
    ]


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("case", range(len(_bad_calls())))
def test_bad_inputs_raise_before_launch(backend, case):
    name, exc, args, kwargs = _bad_calls()[case]
    before = [a.clone() if isinstance(a, torch.Tensor) and a.device.type == "cpu" else a for a in args]
    with flowlock.use_backend(backend), pytest.raises(exc, match=name):
        linear(*args, **kwargs)
    for a, bef in zip(args, before):
        if isinstance(a, torch.Tensor) and a.device.type == "cpu":
            assert bitwise_equal(a, bef), "inputs must be left unchanged"
