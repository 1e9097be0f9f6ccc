"""The panel stream-K candidate (flowlock.ops.linear.gluon_stream) on a CPU host: its kernel compiles for
sm90 (the m64 n256 k16 wgmma of the forward's tile, no spills, shared memory as counted, a relaxed
ticket, a release of the head and an acquire spin for the tail), and the share it is used for is
decided from tile counts as documented. Its bits against the walk are a GPU test
(test_linear_gluon_stream_gpu.py)."""

import torch
from compile_probe import run_compile_probe

from flowlock.config import launch_config
from flowlock.ops.linear import gluon_stream

CFG = launch_config("linear_fwd", torch.bfloat16, "sm90", (7168, 5376)).with_blocks(STREAM_PANELS=1)


def test_panel_stream_compiles_for_sm90():
    found = run_compile_probe("linear_gluon_stream_probe.py")
    assert found["wgmma"] == ["wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16"], found
    assert found["config_shared_bytes"] <= found["shared_bytes"] <= 232448 and found["spill_bytes"] == 0, found
    assert found["atomics"] == ["atom.global.gpu.relaxed.add.u32", "atom.global.gpu.release.exch.b32"], found
    assert found["acquire_loads"] >= 1, found


def test_groups_share_one_row_group_of_one_to_one_and_a_half_rounds():
    """H200 (132 SMs), 128 x 256 tiles: at M = 925 (8 row tiles, 16 groups) out / fc2 (21 panels, 168
    tiles) share; q (28 panels, 1.75 rounds), fc1 (112 panels, 896 tiles: 7 rounds) and fused qkv (672)
    walk; M = 600 (5 row tiles, 26 groups) shares q (28 panels, 140 tiles); M = 300 (84 tiles, one
    round) and M = 4253 (34 row tiles) walk."""
    want = {(925, 7168): 0, (925, 5376): 16, (925, 28672): 0, (925, 21504): 0, (600, 7168): 26, (600, 5376): 0,
            (300, 7168): 0, (4253, 7168): 0}
    assert {key: gluon_stream.groups(*key, CFG, 132) for key in want} == want


def test_applies_needs_the_flags_and_a_gpu():
    t = torch.zeros(925, 8, dtype=torch.bfloat16)
    assert not gluon_stream.applies(CFG, t, False, t, True, torch.zeros(925, 7168, dtype=torch.bfloat16), 132)
    assert not gluon_stream.applies(CFG.with_blocks(STREAM_PANELS=0), t, False, t, True, t, 132)
