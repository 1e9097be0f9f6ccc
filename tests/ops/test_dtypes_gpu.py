"""fp32 / fp16 (and new head dims) of the block-stack ops other than attention on a Hopper GPU
(compiled Triton, frozen sm90 configs): within the FP64 budget of the eager provider in the same
dtype (TF32 off), batch-invariant (attention: test_attention_gpu.py).

    TRITON_INTERPRET=0 python -m pytest -q -m gpu tests/ops/test_dtypes_gpu.py
"""

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_minimax_h3 import (
    MiniMaxH3AdaLayerNormModulation,
    MiniMaxH3AdaLayerNormOut,
    _apply_rotary_emb,
)

from flowlock.ops.adaln import adaln_modulation
from flowlock.ops.adaln.reference import adaln_modulation_golden
from flowlock.ops.final_adaln import final_adaln_out
from flowlock.ops.final_adaln.reference import final_adaln_out_golden
from flowlock.ops.linear import linear
from flowlock.ops.linear.reference import linear_golden
from flowlock.ops.qk_norm_rope import qk_norm_rope
from flowlock.ops.qk_norm_rope.reference import qk_norm_rope_golden
from flowlock.ops.swiglu import swiglu
from flowlock.ops.swiglu.reference import swiglu_golden
from flowlock.testing import assert_batch_invariant, assert_within_budget

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                       reason="needs a Hopper (sm90+) GPU"),
]

DEVICE = "cuda"
DTYPES = (torch.float32, torch.float16)
EPS = 1e-6


def _randn(*shape, dtype, seed, scale=1.0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return (torch.randn(*shape, device=DEVICE, generator=g) * scale).to(dtype)


def _grads(fn, tensors, upstream, double=False):
    leaves = [(t.detach().double() if double else t.detach().clone()).requires_grad_(True) for t in tensors]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    ups = upstream if isinstance(upstream, (list, tuple)) else (upstream,)
    sum((o.double() * u.double()).sum() for o, u in zip(outs, ups)).backward()
    return [o.detach() for o in outs], [t.grad for t in leaves]


def _assert_all_within(what, ours, base, gold):
    for k, (o, b, g) in enumerate(zip(ours, base, gold)):
        assert o.dtype == b.dtype, f"{what} {k}"
        assert_within_budget(o, g, baseline=b, what=f"{what} {k}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, k", [(5376, 7168), (7168, 5376), (24, 40)])
def test_linear(dtype, n, k):
    x, w, b = _randn(4096 + 7, k, dtype=dtype, seed=1), _randn(n, k, dtype=dtype, seed=2, scale=k ** -0.5), \
        _randn(n, dtype=dtype, seed=3)
    dy = _randn(4096 + 7, n, dtype=dtype, seed=4)
    ours = _grads(linear, (x, w, b), dy)
    base = _grads(F.linear, (x, w, b), dy)
    gold = _grads(lambda *a: linear_golden(*a, out_dtype=dtype), (x, w, b), dy, double=True)
    _assert_all_within(f"linear {dtype} out", ours[0], base[0], gold[0])
    _assert_all_within(f"linear {dtype} grads", ours[1], base[1], gold[1])
    assert_batch_invariant(lambda xs: linear(xs, w, b), x[:16 * 64].reshape(16, 64, k))


@pytest.mark.parametrize("dtype", DTYPES + (torch.bfloat16,))
@pytest.mark.parametrize("d, freq", [(16, 2), (48, 8), (128, 16), (256, 16)])
def test_qk_norm_rope(dtype, d, freq):
    x, w = _randn(2, 777, 4, d, dtype=dtype, seed=d, scale=3.0), _randn(d, dtype=dtype, seed=1, scale=0.3) + 1
    angles = torch.rand(777, 3 * freq, device=DEVICE) * 50
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    up = _randn(2, 777, 4, d, dtype=dtype, seed=9)
    ours = _grads(lambda a, b: qk_norm_rope(a, b, cos, sin, EPS), (x, w), up)
    base = _grads(lambda a, b: _apply_rotary_emb(F.rms_norm(a, (d,), b, EPS), cos, sin), (x, w), up)
    gold = _grads(lambda a, b: qk_norm_rope_golden(a, b, cos, sin, EPS, dtype), (x, w), up, double=True)
    _assert_all_within(f"qk_norm_rope {dtype} D={d}", ours[0] + ours[1], base[0] + base[1], gold[0] + gold[1])
    assert_batch_invariant(lambda xs: qk_norm_rope(xs, w, cos, sin, EPS), x, sizes=(2,))


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu(dtype):
    h, up = _randn(4, 1000, 2 * 1432, dtype=dtype, seed=1, scale=4.0), _randn(4, 1000, 1432, dtype=dtype, seed=2)
    ours = _grads(swiglu, (h,), up)
    base = _grads(lambda t: t.chunk(2, -1)[0] * F.silu(t.chunk(2, -1)[1]), (h,), up)
    gold = _grads(lambda t: swiglu_golden(t, dtype), (h,), up, double=True)
    assert torch.equal(ours[0][0], base[0][0]), "swiglu forward bitwise eager"
    _assert_all_within(f"swiglu {dtype}", ours[1], base[1], gold[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_adaln_modulation(dtype):
    e, h, s = 2688, 512, 4096
    temb, w, b = _randn(3, e, dtype=torch.float32, seed=1), _randn(18 * h, e, dtype=dtype, seed=2, scale=0.02), \
        _randn(18 * h, dtype=dtype, seed=3, scale=0.2)
    g = torch.Generator(device=DEVICE).manual_seed(4)
    ti, tag = (torch.randint(0, 3, (s,), device=DEVICE, generator=g) for _ in range(2))
    up = [_randn(s, h, dtype=dtype, seed=10 + c) for c in range(6)]

    def eager(temb, w, b):
        module = MiniMaxH3AdaLayerNormModulation(e, h).to(DEVICE, dtype)
        chunks = torch.func.functional_call(module, {"linear.weight": w, "linear.bias": b}, (temb,))
        return tuple(c.index_select(0, ti * 3 + tag) for c in chunks)

    ours = _grads(lambda *a: adaln_modulation(*a, ti, tag), (temb, w, b), up)
    base = _grads(eager, (temb, w, b), up)
    gold = _grads(lambda *a: adaln_modulation_golden(*a, ti, tag, dtype), (temb, w, b), up, double=True)
    _assert_all_within(f"adaln {dtype} out", ours[0], base[0], gold[0])
    _assert_all_within(f"adaln {dtype} grads", ours[1], base[1], gold[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_final_adaln_out(dtype):
    e, h, s = 2688, 512, 4096 + 5
    x, temb = _randn(2, s, h, dtype=dtype, seed=1, scale=3.0), _randn(2, e, dtype=torch.float32, seed=2)
    nw, w, b = (_randn(h, dtype=dtype, seed=3) * 0.3 + 1, _randn(2 * h, e, dtype=dtype, seed=4, scale=0.02),
                _randn(2 * h, dtype=dtype, seed=5, scale=0.2))
    ti = torch.randint(0, 2, (s,), device=DEVICE, generator=torch.Generator(device=DEVICE).manual_seed(6))
    up = _randn(2, s, h, dtype=dtype, seed=7)

    def eager(x, temb, nw, w, b):
        module = MiniMaxH3AdaLayerNormOut(h, e, EPS).to(DEVICE, dtype)
        return torch.func.functional_call(module, {"norm.weight": nw, "linear.weight": w, "linear.bias": b},
                                          (x, temb, ti))

    ours = _grads(lambda *a: final_adaln_out(*a, ti, EPS), (x, temb, nw, w, b), up)
    base = _grads(eager, (x, temb, nw, w, b), up)
    gold = _grads(lambda *a: final_adaln_out_golden(*a, ti, EPS, dtype), (x, temb, nw, w, b), up, double=True)
    _assert_all_within(f"final_adaln {dtype}", ours[0] + ours[1], base[0] + base[1], gold[0] + gold[1])
    assert_batch_invariant(lambda xs: final_adaln_out(xs, temb, nw, w, b, ti, EPS), x, sizes=(2,))
