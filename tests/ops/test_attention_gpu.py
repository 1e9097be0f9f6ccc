"""attention on a Hopper GPU (compiled Triton): the TMA-descriptor kernels give the pointer kernels'
bits at the frozen sm90 tiles (forward out and lse2; backward dq, dk, dv, where the TMA configs run the
one-pass Gluon backward at D = 128 and the pointer configs the separate kernels with the folded dQ;
ragged tails, one token, fused-qkv views), the TMA path is batch-invariant, and the no-graph call
equals the graphed one.

    TRITON_INTERPRET=0 python -m pytest -q -m gpu tests/ops/test_attention_gpu.py
"""

import pytest
import torch

from flowlock.config import LaunchConfig, launch_config
from flowlock.keys import arch_of
from flowlock.ops.attention import attention
from flowlock.ops.attention.triton import attention_bwd, attention_fwd, tma_eligible
from flowlock.testing import assert_batch_invariant, assert_bitwise_equal

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                       reason="needs a Hopper (sm90+) GPU"),
]

DEVICE = "cuda"
D = 128
SCALE = D ** -0.5


def _frozen(op, tma):
    """The frozen sm90 config of ``op`` with its ``TMA`` key set to ``tma``."""
    cfg = launch_config(op, torch.bfloat16, arch_of(torch.empty(0, device=DEVICE)), (D,))
    blocks = tuple((k, int(tma) if k == "TMA" else v) for k, v in cfg.blocks)
    assert dict(blocks)["BLOCK_M"] >= 64, "not the sm90 entry"
    return LaunchConfig(blocks, cfg.num_warps, cfg.num_stages)


def _configs(tma):
    return tuple(_frozen(op, tma) for op in ("attention_fwd", "attention_bwd_dkdv", "attention_bwd_dq"))


def _fused(b, s, h, seed):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    qkv = torch.randn(b, s, 3 * h * D, device=DEVICE, generator=g).bfloat16()
    do = torch.randn(b, s, h, D, device=DEVICE, generator=g).bfloat16()
    q, k, v = (t.unflatten(-1, (h, D)) for t in qkv.chunk(3, dim=-1))
    return q, k, v, do


def _run(q, k, v, do, fwd_cfg, dkdv_cfg, dq_cfg):
    out, lse2 = attention_fwd(q, k, v, SCALE, fwd_cfg)
    return (out, lse2, *attention_bwd(do, q, k, v, out, lse2, SCALE, dkdv_cfg, dq_cfg))


@pytest.mark.parametrize("b,s,h", [(2, 1, 3), (2, 77, 4), (1, 4096 + 33, 2)])
def test_tma_kernels_equal_pointer_kernels(b, s, h):
    inputs = _fused(b, s, h, seed=s)
    assert all(tma_eligible(t) for t in inputs)
    tma, pointer = _run(*inputs, *_configs(True)), _run(*inputs, *_configs(False))
    assert_bitwise_equal(tma[:2], pointer[:2], f"forward out, lse2 at S={s}")
    assert_bitwise_equal(tma[2:], pointer[2:], f"backward dq, dk, dv at S={s}")


def _separate(cfg, **blocks):
    """``cfg`` with ``blocks`` set and the one-pass kernel off (``ONE_PASS=0``): the separate Triton kernels."""
    return cfg.with_blocks(**blocks, **({"ONE_PASS": 0} if "ONE_PASS" in dict(cfg.blocks) else {}))


def _with_dp_first(cfg, dp_first):
    return _separate(cfg, DP_FIRST=dp_first)


@pytest.mark.parametrize("s", [77, 4096 + 33])
def test_dp_first_order_gives_the_same_backward_bits(s):
    """The frozen separate kernels issue dP before the exponentials in dK/dV; both orders, both kernels."""
    inputs = _fused(1, s, 2, seed=s)
    fwd, dkdv, dq = _configs(True)
    early = _run(*inputs, fwd, _with_dp_first(dkdv, 1), _with_dp_first(dq, 1))
    plain = _run(*inputs, fwd, _with_dp_first(dkdv, 0), _with_dp_first(dq, 0))
    assert_bitwise_equal(early[2:], plain[2:], f"backward dq, dk, dv at S={s}")


def test_tma_kernels_batch_invariant():
    pool = _fused(3, 77, 3, seed=1)
    configs = _configs(True)

    def run(q, k, v, do):
        out, lse2, dq, dk, dv = _run(q, k, v, do, *configs)
        return out, lse2, dq, dk, dv

    assert_batch_invariant(run, pool, sizes=(2, 3))


def test_public_call_no_graph_equals_graphed():
    q, k, v, do = _fused(1, 333, 4, seed=2)
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    graphed = attention(*leaves)
    with torch.no_grad():
        plain = attention(q, k, v)
    assert plain.grad_fn is None
    assert_bitwise_equal(plain, graphed.detach(), "no-graph vs graphed forward")
    grads = torch.autograd.grad(graphed, leaves, do)
    assert_bitwise_equal(grads, _run(q, k, v, do, None, None, None)[2:], "public backward vs the launchers")


# New dtypes and head dims (issue 11): frozen sm90 configs compile, stay within the FP64 budget of the
# provider's SDPA in the same dtype (TF32 off: fp32 must beat it, not match TF32 error), and are
# batch-invariant; power-of-two fp16 heads also take the TMA path with the pointer path's bits.
NEW_CASES = [(dt, d) for dt in (torch.float32, torch.float16, torch.bfloat16) for d in (16, 48, 80, 96, 256)
             ] + [(dt, d) for dt in (torch.float32, torch.float16) for d in (32, 64, 128)]


def _dtype_inputs(b, s, h, d, dtype, seed):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return [torch.randn(b, s, h, d, device=DEVICE, generator=g).to(dtype) for _ in range(4)]


def _grads(fn, q, k, v, do):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = fn(*leaves)
    return (out.detach(), *torch.autograd.grad(out, leaves, do))


def _sdpa(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


@pytest.mark.parametrize("dtype, d", NEW_CASES)
def test_new_dtypes_and_head_dims_within_budget(dtype, d):
    from flowlock.ops.attention import attention_golden
    from flowlock.testing import assert_within_budget

    q, k, v, do = _dtype_inputs(2, 1024 + 33, 3, d, dtype, seed=d)
    ours, base = _grads(attention, q, k, v, do), _grads(_sdpa, q, k, v, do)
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    gold_out = attention_golden(*leaves, d ** -0.5, dtype)
    gold = (gold_out.detach(), *torch.autograd.grad(gold_out, leaves, do.double()))
    for name, o, bl, g in zip(("out", "dq", "dk", "dv"), ours, base, gold):
        assert o.dtype == dtype
        assert_within_budget(o, g, baseline=bl, what=f"{name} {dtype} D={d}")


@pytest.mark.parametrize("dtype, d", [(torch.float32, 80), (torch.float16, 256), (torch.bfloat16, 48)])
def test_new_dtypes_and_head_dims_batch_invariant(dtype, d):
    pool = _dtype_inputs(3, 333, 2, d, dtype, seed=1)
    assert_batch_invariant(lambda q, k, v, do: _grads(attention, q, k, v, do), pool, sizes=(2, 3))


@pytest.mark.parametrize("d", [16, 256])
def test_fp16_tma_kernels_equal_pointer_kernels(d):
    q, k, v, do = _dtype_inputs(2, 777, 2, d, torch.float16, seed=d)
    arch = arch_of(q)

    def frozen(op, tma):
        cfg = launch_config(op, torch.float16, arch, (d,))
        return LaunchConfig(tuple((n, int(tma) if n == "TMA" else x) for n, x in cfg.blocks), cfg.num_warps,
                            cfg.num_stages)

    def run(tma):
        fwd, dkdv, dq = (frozen(op, tma) for op in ("attention_fwd", "attention_bwd_dkdv", "attention_bwd_dq"))
        out, lse2 = attention_fwd(q, k, v, d ** -0.5, fwd)
        return (out, lse2, *attention_bwd(do, q, k, v, out, lse2, d ** -0.5, dkdv, dq))

    assert_bitwise_equal(run(True), run(False), f"fp16 D={d} TMA vs pointer")
