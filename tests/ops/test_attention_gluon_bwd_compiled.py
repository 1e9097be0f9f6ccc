"""The one-pass Gluon attention backward (flowlock.ops.attention.gluon_bwd) compiles for sm90 on a CPU
host: its PTX issues the three wgmma shapes of its five products (m64 n64 for S^T and dP^T, m64 n128
for dV and dK, m64 n32 for the dQ term's column chunks), takes the turn with a GPU-scope acquire and
passes it only after waiting for its TMA stores to complete (not only to have read shared memory), and
fits an sm90 program's shared memory. Whether it gives the folded Triton kernels' bits is a GPU test
(test_attention_gluon_bwd_gpu.py)."""

from compile_probe import run_compile_probe


def test_one_pass_backward_compiles_for_sm90():
    found = run_compile_probe("attention_gluon_bwd_probe.py")
    assert found["wgmma"] == ["wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16",
                              "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16",
                              "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16"], found
    assert found["shared_bytes"] <= 232448, found
    assert found["turn_acquire"] and found["turn_release_after_store_completion"], found
