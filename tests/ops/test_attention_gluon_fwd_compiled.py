"""The Gluon attention forward (flowlock.ops.attention.gluon_fwd) compiles for sm90 on a CPU host, with and
without ping-pong: m64 n128 k16 wgmma for both products, within an sm90 program's shared memory (three KV
stages and the two query halves), no spills, partitions that set their register counts (the halves 240,
the producer 24), and the overlap it is built for: a wait that leaves one product in flight (block j's
``P @ V`` while block j + 1's softmax runs), with no wait that ptxas had to add. Ping-pong's 256-thread
barriers appear only where asked for. Whether it keeps the Triton forward's bits is a GPU test."""

from compile_probe import run_compile_probe


def test_gluon_attention_forward_compiles_for_sm90():
    found = run_compile_probe("attention_gluon_fwd_probe.py")
    for variant, f in found.items():
        assert f["wgmma"] == ["wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16"], (variant, f)
        assert f["shared_bytes"] <= 232448 and f["spill_bytes"] == 0, (variant, f)
        assert {240, 24} <= set(f["setmaxnreg"]), (variant, f)
        assert 1 in f["wgmma_wait_groups"], (variant, f)
        assert not f["wgmma_serialized"] and not f["wgmma_wait_injected"], (variant, f)
    assert found["pingpong"]["named_barriers"] and not found["plain"]["named_barriers"], found
