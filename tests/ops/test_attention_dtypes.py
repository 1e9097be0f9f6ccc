"""attention in fp32 / fp16 / bf16 at head dims 16 to 256 (48, 80, 96 padded to their power-of-two
tile): FP64-golden budgets on both backends, batch invariance of the kernel, the reference serving
any head dim and the kernel refusing what no tile serves."""

import re

import pytest
import torch
import torch.nn.functional as F

import flowlock
from flowlock.ops.attention import attention, attention_golden
from flowlock.testing import assert_batch_invariant, assert_within_budget

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _qkv(b, s, h, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(b, s, h, d, generator=g).to(dtype) for _ in range(4))
    return [t.requires_grad_() for t in (q, k, v)], do


def _fwd_bwd(fn, qkv, do):
    out = fn(*qkv)
    return (out.detach(), *torch.autograd.grad(out, qkv, do))


def _backend(name):
    def fn(q, k, v):
        with flowlock.use_backend(name):
            return attention(q, k, v)
    return fn


def _sdpa(q, k, v):
    """The provider's eager baseline in the input dtype (CPU SDPA), in BSHD."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def _golden(qkv, do, dtype):
    leaves = [t.detach().double().requires_grad_() for t in qkv]
    out = attention_golden(*leaves, qkv[0].shape[-1] ** -0.5, dtype)
    return (out.detach(), *torch.autograd.grad(out, leaves, do.double()))


# the interpreter is slow: every dtype at the end points, the three padded dims and H3's 128 once each
CASES = ([(dt, d) for dt in DTYPES for d in (16, 256)]
         + [(torch.float32, 48), (torch.float16, 80), (torch.bfloat16, 96), (torch.float32, 128), (torch.float16, 128)])


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("dtype, d", CASES)
def test_forward_and_grads_within_budget(dtype, d, backend):
    qkv, do = _qkv(1, 19, 2, d, dtype, seed=d)
    ours = _fwd_bwd(_backend(backend), qkv, do)
    base = _fwd_bwd(_sdpa, qkv, do)
    gold = _golden(qkv, do, dtype)
    for name, o, bl, g in zip(("out", "dq", "dk", "dv"), ours, base, gold):
        assert o.dtype == dtype and o.shape == (1, 19, 2, d)
        assert_within_budget(o, g, baseline=bl, what=f"attention {name} {dtype} D={d}")


@pytest.mark.parametrize("d", (12, 40, 200))
def test_reference_serves_any_head_dim(d):
    qkv, do = _qkv(1, 9, 2, d, torch.float32, seed=1)
    ours, gold = _fwd_bwd(_backend("reference"), qkv, do), _golden(qkv, do, torch.float32)
    for name, o, bl, g in zip(("out", "dq", "dk", "dv"), ours, _fwd_bwd(_sdpa, qkv, do), gold):
        assert_within_budget(o, g, baseline=bl, what=f"reference {name} D={d}")


@pytest.mark.parametrize("dtype, d", ((torch.float32, 80), (torch.float16, 16)))
def test_batch_invariant_forward_and_grads(dtype, d):
    g = torch.Generator().manual_seed(3)
    # 17 rows: a full and a masked block of 16 on both sequence axes
    pool = tuple(torch.randn(3, 17, 1, d, generator=g).to(dtype) for _ in range(4))

    def fn(q, k, v, do):
        qkv = [t.clone().requires_grad_() for t in (q, k, v)]
        return _fwd_bwd(_backend("triton"), qkv, do)

    assert_batch_invariant(fn, pool, sizes=(3,))


@pytest.mark.parametrize("d", (8, 12, 20, 100, 264, 512))
def test_triton_refuses_head_dims_no_tile_serves(d):
    q = torch.randn(1, 4, 2, d)
    message = re.escape(f"q head dim must be a multiple of 8 in [16, 256] on the triton backend (the reference "
                        f"backend takes any), got {d}")
    with flowlock.use_backend("triton"), pytest.raises(ValueError, match=message):
        attention(q, q, q)
