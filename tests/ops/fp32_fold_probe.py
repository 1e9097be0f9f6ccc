"""Compile flowlock's true-fp32 GEMM kernels (and the AdaLN table's d_act, whose FP32 gradient
multiplies bf16 weights in fp32), and the attention dQ kernel's per-KV-block fold (``DQ_FOLD``), for
sm90 on this machine (no GPU: Triton's own pipeline up to TTGIR) and print, as JSON, each kernel's
``tt.dot`` ops (``ttng.warp_group_dot``, the wgmma, for bf16): result, accumulator operand and whether
that is a zero constant.

A dot with a zero accumulator means the kernel's compensated block fold survived Triton's combine
pass (which rewrites ``acc + tl.dot(a, b)`` into ``tl.dot(a, b, acc)``). The ``control`` kernel
folds plainly and must come out combined, which shows the probe sees the rewrite; the chained dQ
kernel (``DQ_FOLD=0``) is the same control for the wgmma products. Run with
``TRITON_INTERPRET`` unset (an interpreted kernel cannot be compiled).
"""

from __future__ import annotations

import json
import re

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

from flowlock.ops.adaln import triton as adaln_kernels
from flowlock.ops.attention import triton as attention_kernels
from flowlock.ops.linear import triton as linear_kernels


@triton.jit
def _plain_fold_kernel(a_ptr, b_ptr, c_ptr, K, BLOCK_K: tl.constexpr):
    offs = tl.arange(0, 32)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((32, 32), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        a = tl.load(a_ptr + offs[:, None] * K + k + offs_k[None, :])
        b = tl.load(b_ptr + (k + offs_k[:, None]) * 32 + offs[None, :])
        acc = acc + tl.dot(a, b, input_precision="ieee")
    tl.store(c_ptr + offs[:, None] * 32 + offs[None, :], acc)


def _ttgir(fn, signature: dict, constants: dict) -> str:
    if not isinstance(fn, triton.runtime.JITFunction):
        fn = fn.kernel  # a fast_launch wrapper
    sig = dict(signature, **dict.fromkeys(constants, "constexpr"))
    missing = [n for n in fn.arg_names if n not in sig]
    if missing:
        raise TypeError(f"{fn.__name__}: no signature for {missing}")
    compiled = triton.compile(triton.compiler.ASTSource(fn, sig, constants), target=GPUTarget("cuda", 90, 128),
                              options={"num_warps": 4, "num_stages": 3})
    return compiled.asm["ttgir"]


def _dots(text: str) -> list[dict]:
    zeros = set(re.findall(r"(%[\w.]+) = arith\.constant dense<0\.000000e\+00>", text))
    found = []
    for line in text.splitlines():
        m = re.search(r"(%[\w.]+) = (?:tt\.dot|ttng\.warp_group_dot) (%[\w.]+), (%[\w.]+), (%[\w.]+)", line)
        if m:
            found.append({"out": m.group(1), "acc": m.group(4), "zero_acc": m.group(4) in zeros})
    return found


def main() -> None:
    gemm = dict(HAS_BIAS=True, FP32_DOT=True, COMPENSATED=True, SOFT_BF16=False, BLOCK_I=64, BLOCK_J=64,
                BLOCK_R=32, GROUP_I=8)
    tma_sig = {"a_desc": "tensordesc<fp32[64,32]>", "b_desc": "tensordesc<fp32[64,32]>",
               "c_desc": "tensordesc<fp32[64,64]>", "b_half_desc": "tensordesc<fp32[32,32]>",
               "c_half_desc": "tensordesc<fp32[64,32]>", "bias_ptr": "*fp32", "chain_ptr": "*fp32", "turns": "*i32",
               "I": "i32", "J": "i32", "R": "i32"}
    ptr_sig = dict.fromkeys(("I", "J", "R", "stride_ai", "stride_ar", "stride_br", "stride_bj", "stride_ci",
                             "stride_cj"), "i32")
    ptr_sig.update(a_ptr="*fp32", b_ptr="*fp32", bias_ptr="*fp32", c_ptr="*fp32")
    adaln_sig = {"act_ptr": "*fp32", "w_ptr": "*fp32", "b_ptr": "*fp32", "out_ptr": "*fp32",
                 "T": "i32", "N": "i32", "E": "i32"}
    cases = {"control": (_plain_fold_kernel, {"a_ptr": "*fp32", "b_ptr": "*fp32", "c_ptr": "*fp32", "K": "i32"},
                         {"BLOCK_K": 32}),
             "linear_ptr": (linear_kernels._linear_gemm_kernel, ptr_sig, dict(gemm, UNIT=0)),
             "linear_ptr_units": (linear_kernels._linear_gemm_kernel, ptr_sig, dict(gemm, UNIT=1024)),
             "adaln_table_fwd": (adaln_kernels._adaln_table_fwd_kernel, adaln_sig,
                                 dict(BLOCK_T=16, BLOCK_N=64, BLOCK_K=64, UPCAST=False)),
             "adaln_table_bwd": (adaln_kernels._adaln_table_bwd_kernel,
                                 {"g_ptr": "*fp32", "w_ptr": "*bf16", "part_ptr": "*fp32", "T": "i32", "N": "i32",
                                  "E": "i32"}, dict(BLOCK_T=16, BLOCK_N=64, BLOCK_K=64, CHUNK_N=512, SPLIT=False)),
             # bf16 weights: the three split parts chain into one tile product, which then folds compensated
             "adaln_table_bwd_split": (adaln_kernels._adaln_table_bwd_kernel,
                                       {"g_ptr": "*fp32", "w_ptr": "*bf16", "part_ptr": "*fp32", "T": "i32",
                                        "N": "i32", "E": "i32"},
                                       dict(BLOCK_T=16, BLOCK_N=64, BLOCK_K=64, CHUNK_N=512, SPLIT=True))}
    # the attention dQ kernel's DQ_FOLD: each KV block's term from zero, then one fp32 addition
    attention_sig = dict.fromkeys(("Q", "K", "V", "dOut", "dQ"), "*bf16")
    attention_sig.update(dict.fromkeys(("Lse2", "Delta"), "*fp32"), seq="i32", heads="i32", qk_scale="fp32",
                         sm_scale="fp32")
    attention_sig.update(dict.fromkeys((f"stride_{t}{a}" for t in "qkvdg" for a in "bsh"), "i32"))
    # (bf16 products become wgmma, ttng.warp_group_dot); its chained order is the second control
    attention = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_D=128, HEAD_DIM=128, UPCAST=False, TMA=False, DP_FIRST=False)
    for name, fold in (("attention_dq_fold", True), ("control_attention_dq_chain", False)):
        cases[name] = (attention_kernels._attention_bwd_dq_kernel, attention_sig, dict(attention, DQ_FOLD=fold))
    for units, flat in ((0, False), (1024, False), (1024, True)):
        cases[f"linear_tma_unit{units}{'_flat' if flat else ''}"] = (
            linear_kernels._linear_gemm_tma_kernel, tma_sig,
            dict(gemm, UNIT=units, A_T=False, B_T=True, EPI_SPLIT=False, FLATTEN=False, FLAT_UNITS=flat,
                 TAIL_SPLIT=True, STREAM_K=False, NUM_PROGRAMS=132))
    print(json.dumps({name: _dots(_ttgir(*case)) for name, case in cases.items()}))


if __name__ == "__main__":
    main()
