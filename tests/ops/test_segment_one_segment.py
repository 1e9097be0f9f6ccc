"""ONE_SEGMENT (``segment_sum_partials`` config): a tile whose rows all carry one segment reduces that
segment alone and stores the others as +0.0. Every consumer of the shared ``segment_partials`` code
(segment_sum, the gated residual's backward, the modulated norm's table gradients) gives the bits it
gives with every segment reduced, on tiles of one segment, of several, and past the last row.
Triton runs under the interpreter; ``test_segment_one_segment_gpu.py`` checks the same on a GPU."""

from __future__ import annotations

import pytest
import torch

from flowlock.config import launch_config
from flowlock.ops.gate_residual import triton as gt
from flowlock.ops.rms_norm import triton as rt
from flowlock.ops.segment_sum import triton as st
from flowlock.testing import assert_bitwise_equal

BF16 = torch.bfloat16


def _runs(s: int) -> torch.Tensor:
    """An H3-like row index of ``s`` rows, 3 segments in runs (text, video, audio), which puts both
    tiles of one segment and tiles where two meet among the 64-row tiles."""
    text, audio = s // 4, s // 16
    return torch.cat([torch.zeros(text), torch.ones(s - text - audio), torch.full((audio,), 2)]).long()


def _configs():
    frozen = launch_config("segment_sum_partials", BF16, "interp")
    assert frozen["ONE_SEGMENT"] == 1 and frozen["TILE_ROWS"] == 64
    return frozen, frozen.with_blocks(ONE_SEGMENT=0)


def _tiles_of_one_and_several(index: torch.Tensor, rows: int) -> tuple[int, int]:
    per_row = index.repeat(-(-rows // index.numel()))[:rows]
    kinds = [per_row[t:t + 64].unique().numel() for t in range(0, rows, 64)]
    return sum(k == 1 for k in kinds), sum(k > 1 for k in kinds)


@pytest.mark.parametrize(("batch", "s", "single"), [(1, 200, False), (2, 150, False), (1, 37, False), (1, 100, True)])
def test_segment_sum_partials(batch, s, single):
    """200 and 2 x 150 rows hold tiles of one segment and tiles of several; 37 rows are one tile of three
    segments past whose end rows are masked; 100 rows of segment 1 alone are two tiles of one segment,
    the second ending past the last row, where segments 0 and 2 have no row at all."""
    g = torch.Generator().manual_seed(s)
    index = torch.ones(s, dtype=torch.long) if single else _runs(s)
    values = torch.randn(batch * s, 40, generator=g).to(BF16)
    other = torch.randn(batch * s, 40, generator=g).to(BF16)
    one, several = _tiles_of_one_and_several(index, batch * s)
    assert (one, several) == {37: (0, 1), 100: (2, 0)}.get(s, (one, several)) and (s < 150 or one * several > 0)
    frozen, every = _configs()
    for kwargs in ({}, {"other": other}, {"other": other, "pair": True}):
        width = 3 * 40 * (2 if kwargs.get("pair") else 1)
        got, want = (torch.full((st.num_tiles(values), width), float("nan")) for _ in range(2))
        st.write_segment_partials(got, values, index, 3, period=s, config=frozen, **kwargs)
        st.write_segment_partials(want, values, index, 3, period=s, config=every, **kwargs)
        assert_bitwise_equal(got, want, f"partials {kwargs.keys()}")


def test_gate_residual_backward():
    g = torch.Generator().manual_seed(3)
    s, h = 150, 40
    index = _runs(s)
    gate = torch.randn(3, h, generator=g)
    y, dout = (torch.randn(2, s, h, generator=g).to(BF16) for _ in range(2))
    frozen, every = _configs()
    got, want = gt.gate_residual_bwd(dout, gate, y, index, frozen), gt.gate_residual_bwd(dout, gate, y, index, every)
    assert_bitwise_equal(got[0], want[0], "d_y")
    assert_bitwise_equal(got[1], want[1], "d_gate")


def test_rms_norm_modulate_backward():
    g = torch.Generator().manual_seed(4)
    s, h = 200, 48
    index = _runs(s)
    x, dy = (torch.randn(s, h, generator=g).to(BF16) for _ in range(2))
    weight = (1 + 0.3 * torch.randn(h, generator=g)).to(BF16)
    shift, scale = (0.5 * torch.randn(3, h, generator=g) for _ in range(2))
    _, rstd = rt.rms_norm_fwd(x, weight, 1e-6, shift, scale, index)
    frozen, every = _configs()
    got = rt.rms_norm_bwd(dy, x, weight, rstd, shift, scale, index, segment_config=frozen)
    want = rt.rms_norm_bwd(dy, x, weight, rstd, shift, scale, index, segment_config=every)
    for name, a, b in zip(("dx", "dweight", "dshift", "dscale"), got, want):
        assert_bitwise_equal(a, b, name)
