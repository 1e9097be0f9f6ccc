"""The true-fp32 GEMMs' compensated block fold must survive Triton's compiler.

Triton's combine pass rewrites ``acc + tl.dot(a, b)`` into ``tl.dot(a, b, acc)``, which turns a
kernel that sums each K block from zero into one FMA chain over the whole reduction, silently (on
an H200 the fp32 linear dX error grew to 2.5x cuBLAS's). This compiles the fp32 linear (pointer
and TMA kernels, with and without token units) and AdaLN projection kernels, and the attention dQ
kernel with ``DQ_FOLD=1`` (whose terms the one-pass backward adds by TMA reduction), for sm90 on the CPU
(Triton's own pipeline to TTGIR, no GPU) in a subprocess with the interpreter off, and asserts that
every product starts from a zero accumulator; the probe's plain-fold controls must come out
combined, which shows the check sees the rewrite.
"""

from compile_probe import run_compile_probe


def test_fp32_block_fold_is_not_combined_into_one_chain():
    dots = run_compile_probe("fp32_fold_probe.py", timeout=600)
    control = dots.pop("control")
    assert control and not any(d["zero_acc"] for d in control), "the control's plain fold was not combined"
    chain = dots.pop("control_attention_dq_chain")
    assert any(not d["zero_acc"] for d in chain), "the chained attention dQ kernel shows no accumulating product"
    for kernel, found in dots.items():
        assert found, f"{kernel}: no tt.dot in its TTGIR"
        chained = [d["acc"] for d in found if not d["zero_acc"]]
        if kernel.endswith("_split"):
            # one tile product from zero; the other split parts chain into it, never into the running sum
            products = {d["out"] for d in found}
            assert sum(d["zero_acc"] for d in found) == 1 and all(a in products for a in chained), (kernel, found)
            continue
        assert not chained, f"{kernel}: tt.dot accumulates into {chained}: the compensated fold was combined away"
