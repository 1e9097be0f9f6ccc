"""The one-pass Gluon attention backward (flowlock.ops.attention.gluon_bwd) compiles for sm90 on a CPU
host: its PTX issues the two wgmma shapes of its five products (m64 n64 for S^T, dP^T and each
warpgroup's half of the dQ term, m64 n128 for dV and dK), adds the term by TMA reduction after taking
the turn with a GPU-scope acquire, passes the turn only after waiting for its bulk writes to complete
(not only to have read shared memory), fits an sm90 program's shared memory without spilling more
than a few hundred bytes, and keeps its wgmma products asynchronous (ptxas serialises them all when a
non-wgmma instruction reads an accumulator in flight), and never makes ptxas wait for its products before
an instruction it cannot prove safe (a warpgroup.wait ptxas injects stalls the warpgroup until every
product in flight has finished: it did before the term's store while the next S^T product ran, when the
store read the term's accumulator registers across the loop). Whether it gives the folded Triton kernels'
bits is a GPU test (test_attention_gluon_bwd_gpu.py)."""

from compile_probe import run_compile_probe


def test_one_pass_backward_compiles_for_sm90():
    found = run_compile_probe("attention_gluon_bwd_probe.py")
    assert found["wgmma"] == ["wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16",
                              "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16"], found
    assert found["fold_adds"] == ["cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.bulk_group"], found
    assert found["shared_bytes"] <= 232448, found
    assert found["spill_bytes"] <= 1024, found
    assert not found["wgmma_serialized"], found
    assert not found["wgmma_wait_injected"], found
    assert found["turn_acquire"] and found["turn_release_after_completion"], found
