"""attention backward with dQ added in turn by the dK/dV kernel (``FUSED_DQ``), interpreted: the same
dq, dk, dv bits as the separate dQ kernel (KV blocks ascending) at ragged lengths, several heads and
samples, padded head dims, every dtype and KV tiles wider or narrower than the dQ kernel's; a planted
out-of-order turn is caught; and the launcher's scratch (ticket, turn counters, fp32 dQ rows) is
zeroed per call, so a second call repeats the first."""

import importlib

import pytest
import torch

from flowlock.config import LaunchConfig
from flowlock.testing import assert_bitwise_equal

kernels = importlib.import_module("flowlock.ops.attention.triton")


def _cfg(block_m, block_n, fused_dq):
    return LaunchConfig((("BLOCK_M", block_m), ("BLOCK_N", block_n), ("FUSED_DQ", fused_dq)), num_warps=4)


def _case(b, s, h, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(b, s, h, d, generator=g).to(dtype) for _ in range(4))
    scale = d ** -0.5
    out, lse2 = kernels.attention_fwd(q, k, v, scale)
    return do, q, k, v, out, lse2, scale


def _backward(case, dkdv_cfg, dq_cfg=None):
    return kernels.attention_bwd(*case, dkdv_cfg, dq_cfg or _cfg(16, 16, 0))


@pytest.mark.parametrize("b,s,h,d,dtype", [
    (1, 1, 1, 16, torch.bfloat16),      # one token: one KV block, first and last at once
    (2, 37, 2, 16, torch.bfloat16),     # ragged query and KV blocks, two samples
    (1, 64, 3, 32, torch.bfloat16),     # whole blocks only
    (1, 45, 2, 24, torch.bfloat16),     # padded head (24 -> 32 columns)
    (1, 33, 2, 16, torch.float16),
    (1, 29, 1, 16, torch.float32),
])
def test_fused_dq_gives_the_separate_kernels_bits(b, s, h, d, dtype):
    case = _case(b, s, h, d, dtype, seed=s)
    separate = _backward(case, _cfg(16, 16, 0))
    fused = _backward(case, _cfg(16, 16, 1))
    assert_bitwise_equal(fused, separate, f"dq, dk, dv at B={b} S={s} heads={h} D={d} {dtype}")


@pytest.mark.parametrize("block_m,block_n", [(16, 32), (32, 16)])
def test_fused_tiles_wider_or_narrower_than_the_dq_kernel(block_m, block_n):
    """A KV tile of 32 adds two of the dQ kernel's 16-wide blocks per turn, still ascending."""
    case = _case(1, 50, 2, 16, torch.bfloat16, seed=3)
    separate = _backward(case, _cfg(16, 16, 0))
    assert_bitwise_equal(_backward(case, _cfg(block_m, block_n, 1)), separate, f"tiles {block_m} x {block_n}")


def test_second_call_repeats_the_first():
    case = _case(2, 21, 2, 16, torch.bfloat16, seed=5)
    first = tuple(t.clone() for t in _backward(case, _cfg(16, 16, 1)))
    assert_bitwise_equal(_backward(case, _cfg(16, 16, 1)), first, "second fused backward")


def test_a_turn_taken_out_of_order_is_caught(monkeypatch):
    """Programs run in ticket order under the interpreter; a ticket that starts past zero hands KV
    block 1 a query block whose turn counter still reads 0, and the wait's assertion fires."""
    zeros = torch.zeros

    def ticket_starts_at_one(*size, **kw):
        t = zeros(*size, **kw)
        if t.dtype == torch.int32:
            t[0] = 1
        return t

    monkeypatch.setattr(kernels.torch, "zeros", ticket_starts_at_one)
    case = _case(1, 40, 1, 16, torch.bfloat16, seed=7)
    with pytest.raises(Exception, match="turn taken out of order"):
        _backward(case, _cfg(16, 16, 1))


def _fold_dq_cfg(block_n):
    return LaunchConfig((("BLOCK_M", 16), ("BLOCK_N", block_n), ("DQ_FOLD", 1)), num_warps=4)


@pytest.mark.parametrize("block_n,d,dtype", [(16, 16, torch.bfloat16), (32, 16, torch.bfloat16),
                                             (16, 24, torch.float16), (32, 16, torch.float32)])
def test_fused_fold_gives_the_folded_dq_kernels_bits(block_n, d, dtype):
    """``FUSED_DQ=2`` (each KV block's dQ term from zero, added in turn) and the dQ kernel with
    ``DQ_FOLD=1`` on KV blocks of the same width compute one sum in one order."""
    case = _case(2, 45, 2, d, dtype, seed=block_n)
    folded = _backward(case, _cfg(16, block_n, 0), _fold_dq_cfg(block_n))
    fused = _backward(case, _cfg(16, block_n, 2))
    assert_bitwise_equal(fused, folded, f"FUSED_DQ=2 at KV blocks of {block_n}, D={d}, {dtype}")
