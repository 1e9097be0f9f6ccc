"""The Gluon dW candidate (flowlock.ops.linear.gluon_dw) compiles for sm90 on a CPU host: its PTX issues
the m64 n128 k16 wgmma of the two half tiles, synchronizes the consumer's 8 warps before each stage
release, fits an sm90 program's shared memory as ``shared_bytes`` counts it (the ring of two stages
and the fp32 total tile), and ptxas allocates it without spilling. Whether it keeps the Triton
kernel's bits is a GPU test (test_linear_gluon_dw_gpu.py)."""

import pytest
import torch
from compile_probe import run_compile_probe

from flowlock.config import launch_config
from flowlock.ops.linear import gluon_dw


def test_gluon_dw_compiles_for_sm90_without_spills():
    found = run_compile_probe("linear_gluon_dw_probe.py")
    assert found["wgmma"] == ["wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16"], found
    assert found["partition_barriers"] >= 1, found
    assert found["config_shared_bytes"] <= found["shared_bytes"] <= 232448, found
    assert found["spill_bytes"] == 0, found


def test_gluon_dw_refuses_a_ring_that_overflows_shared_memory_before_launching():
    """CPU tensors: nothing would run. Three stages beside the 128 KiB total are 272 KiB."""
    cfg = launch_config("linear_dw", torch.bfloat16, "sm90", (7168, 5376)).with_blocks(GLUON=1, RING=3)
    assert gluon_dw.shared_bytes(cfg) == 2 * 3 * (128 + 256) * 64 + 4 * 128 * 256
    dy, x, c = (torch.zeros(64, 128, dtype=torch.bfloat16), torch.zeros(64, 256, dtype=torch.bfloat16),
                torch.zeros(128, 256, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="shared memory"):
        gluon_dw.gemm_dw(dy, x, c, cfg, programs=1)
    assert gluon_dw.shared_bytes(cfg.with_blocks(RING=2)) <= gluon_dw.SHARED_BYTES


def test_gluon_dw_applies_only_to_dw_products():
    cfg = launch_config("linear_dw", torch.bfloat16, "sm90", (7168, 5376)).with_blocks(GLUON=1, RING=2)
    t = torch.zeros(8, 8, dtype=torch.bfloat16)
    assert not gluon_dw.applies(cfg, t, True, t, False, t), "CPU tensors never take the Gluon kernel"
    assert not gluon_dw.applies(cfg.with_blocks(GLUON=0), t, True, t, False, t)
