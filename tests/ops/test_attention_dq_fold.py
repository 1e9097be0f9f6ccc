"""attention dQ folded per KV block (``DQ_FOLD=1``, the frozen sm90 dQ order at D = 128), interpreted: each
block's term from zero, then one fp32 addition. The interpreter's products are already summed from zero
and then added, so the fold gives the chained kernel's bits there, at KV blocks narrower and wider than the
dK/dV kernel's, ragged lengths, two samples, a padded head and every dtype; dK and dV are untouched."""

import pytest
import torch

from flowlock.config import LaunchConfig
from flowlock.ops.attention.triton import attention_bwd, attention_fwd
from flowlock.testing import assert_bitwise_equal


def _dq_cfg(block_n, fold):
    return LaunchConfig((("BLOCK_M", 16), ("BLOCK_N", block_n), ("DQ_FOLD", fold)), num_warps=4)


@pytest.mark.parametrize("b,s,h,d,block_n,dtype", [
    (1, 1, 1, 16, 16, torch.bfloat16),     # one token: one KV block
    (2, 45, 2, 16, 16, torch.bfloat16),    # ragged query and KV blocks, two samples
    (1, 45, 2, 16, 32, torch.bfloat16),    # KV blocks wider than the dK/dV kernel's
    (1, 45, 2, 24, 16, torch.float16),     # padded head (24 -> 32 columns)
    (1, 29, 1, 16, 32, torch.float32),
])
def test_folded_dq_gives_the_chained_bits_under_the_interpreter(b, s, h, d, block_n, dtype):
    g = torch.Generator().manual_seed(s + block_n)
    q, k, v, do = (torch.randn(b, s, h, d, generator=g).to(dtype) for _ in range(4))
    scale = d ** -0.5
    out, lse2 = attention_fwd(q, k, v, scale)
    chained = attention_bwd(do, q, k, v, out, lse2, scale, dq_config=_dq_cfg(block_n, 0))
    folded = attention_bwd(do, q, k, v, out, lse2, scale, dq_config=_dq_cfg(block_n, 1))
    assert_bitwise_equal(folded, chained, f"dq, dk, dv at B={b} S={s} D={d} KV blocks of {block_n} {dtype}")
