"""ONE_SEGMENT on a GPU at H3's widths and row layouts: segment_sum's partials, the gated residual's
backward and the modulated norm's backward give the bits they give with every segment reduced.

    TRITON_INTERPRET=0 python -m pytest -q -m gpu tests/ops/test_segment_one_segment_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from flowlock.config import config_for
from flowlock.ops.gate_residual import triton as gt
from flowlock.ops.rms_norm import triton as rt
from flowlock.ops.segment_sum import triton as st
from flowlock.testing import bitwise_equal

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BF16 = torch.bfloat16
H = 5376


def _index(s: int) -> torch.Tensor:
    """H3's rows: 256 text, the video rows, S / 16 audio; three table rows."""
    audio = s // 16
    return torch.cat([torch.zeros(256), torch.ones(s - 256 - audio), torch.full((audio,), 2)]).long().cuda()


@pytest.mark.parametrize(("batch", "s"), [(1, 925), (2, 925), (1, 4253)])
def test_one_segment_keeps_the_bits(batch, s):
    g = torch.Generator(device="cuda").manual_seed(s + batch)
    index = _index(s)
    x, dy, y = (torch.randn(batch, s, H, generator=g, device="cuda").to(BF16) for _ in range(3))
    weight = (1 + 0.3 * torch.randn(H, generator=g, device="cuda")).to(BF16)
    shift, scale, gate = (0.5 * torch.randn(3, H, generator=g, device="cuda") for _ in range(3))
    frozen = config_for("segment_sum_partials", x)
    assert frozen["ONE_SEGMENT"] == 1
    every = frozen.with_blocks(ONE_SEGMENT=0)
    rows = dy.reshape(-1, H)
    partials = {}
    for name, cfg in (("one", frozen), ("every", every)):
        out = torch.full((st.num_tiles(rows), 6 * H), float("nan"), device="cuda")
        st.write_segment_partials(out, rows, index, 3, other=y.reshape(-1, H), period=s, pair=True, config=cfg)
        partials[name] = out
    assert bitwise_equal(partials["one"], partials["every"]), "segment_sum partials"
    got, want = gt.gate_residual_bwd(dy, gate, y, index, frozen), gt.gate_residual_bwd(dy, gate, y, index, every)
    assert all(bitwise_equal(a, b) for a, b in zip(got, want)), "gate_residual backward"
    _, rstd = rt.rms_norm_fwd(x, weight, 1e-6, shift, scale, index)
    got = rt.rms_norm_bwd(dy, x, weight, rstd, shift, scale, index, segment_config=frozen)
    want = rt.rms_norm_bwd(dy, x, weight, rstd, shift, scale, index, segment_config=every)
    for name, a, b in zip(("dx", "dweight", "dshift", "dscale"), got, want):
        assert bitwise_equal(a, b), f"rms_norm_modulate backward {name}"
