"""The Gluon GEMM (flowlock.ops.linear.gluon) compiles for sm90 on a CPU host, for the forward (weight
stored transposed, with bias) and dX: its PTX issues the m64 n256 k16 wgmma of the Triton kernel's
full tile and the m64 n128 k16 of its split tail's half tile, synchronizes the consumer's 8 warps
before each stage release, and fits an sm90 program's shared memory as ``shared_bytes`` counts it.
Whether it keeps the Triton kernel's bits is a GPU test (test_linear_gluon_gpu.py)."""

from compile_probe import run_compile_probe


def test_gluon_gemm_compiles_for_sm90():
    found = run_compile_probe("linear_gluon_probe.py")
    for product in ("forward", "dx"):
        got = found[product]
        assert got["wgmma"] == ["wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16",
                                "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16"], (product, got)
        assert got["partition_barriers"] >= 1, (product, got)
        assert got["config_shared_bytes"] <= got["shared_bytes"] <= 232448, (product, got)


def test_gluon_rejects_a_config_whose_ring_and_tile_overflow_shared_memory():
    """Before any launch (CPU tensors: nothing would run): RING = 4 of 128 x 256 tiles is 256 KiB."""
    import pytest
    import torch

    from flowlock.config import launch_config
    from flowlock.ops.linear import gluon as lg

    cfg = launch_config("linear_fwd", torch.bfloat16, "sm90", (7168, 5376)).with_blocks(GLUON=1, RING=4)
    assert lg.shared_bytes(cfg) == 2 * (4 * (128 + 256) * 64 + 128 * 256)
    a, b, c = torch.zeros(8, 64, dtype=torch.bfloat16), torch.zeros(256, 64, dtype=torch.bfloat16), None
    with pytest.raises(ValueError, match="shared memory"):
        lg.gemm(a, b, True, c, None, cfg, programs=1, tail_split=True)
    assert lg.shared_bytes(cfg.with_blocks(RING=3)) <= lg.SHARED_BYTES
