"""The CPU backend of adaln_table at H3's embedding width: a row's table is the same bits whatever
other timesteps share the call (a float32 CPU GEMM changed one element of 4096 here between T=1
and T=3; the reference accumulates in float64 so its rounded rows do not depend on T)."""

import torch

from flowlock.ops.adaln.reference import adaln_projection_reference
from flowlock.testing import assert_bitwise_equal


def test_reference_rows_independent_of_other_timesteps_at_h3_width():
    gen = torch.Generator().manual_seed(0)
    e, n = 2688, 4096
    temb = torch.randn(3, e, generator=gen)
    weight = (torch.randn(n, e, generator=gen) * 0.02).to(torch.bfloat16)
    bias = (torch.randn(n, generator=gen) * 0.1).to(torch.bfloat16)
    together = adaln_projection_reference(temb, weight, bias)
    for i in range(3):
        assert_bitwise_equal(adaln_projection_reference(temb[i:i + 1], weight, bias)[0], together[i], f"row {i}")
