"""The Gluon attention forward candidate (flowlock.ops.attention.gluon_fwd) compiles for sm90 on a CPU
host: m64 n128 k16 wgmma for both products, within an sm90 program's shared memory (three KV stages
and the two query halves), no spills, and partitions that set their register counts (the second half
232, the producer 40). Whether it keeps the Triton forward's bits is a GPU test."""

from compile_probe import run_compile_probe


def test_gluon_attention_forward_compiles_for_sm90():
    found = run_compile_probe("attention_gluon_fwd_probe.py")
    assert found["wgmma"] == ["wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16"], found
    assert found["shared_bytes"] <= 232448 and found["spill_bytes"] == 0, found
    assert {232, 40} <= set(found["setmaxnreg"]), found
