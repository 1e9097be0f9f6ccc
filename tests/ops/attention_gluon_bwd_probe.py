"""Compile flowlock.ops.attention.gluon_bwd's kernel for sm90 on this machine (Triton's pipeline to PTX,
no GPU) for H3's attention (56 heads of 128, bf16) and print, as JSON: the wgmma instructions, its
shared memory, ptxas's registers and spill bytes, and the register counts its partitions set. Run by
test_attention_gluon_bwd_compiled.py in a subprocess with the interpreter off."""

import json
import re

import torch
from compile_probe import compile_gluon_sm90
from triton.runtime.jit import mangle_type

from flowlock.ops.attention import gluon_bwd as gb
from flowlock.ops.attention.gluon_operands import bshd_descriptor


def main() -> None:
    q = torch.empty(1, 4253, 56, 128, dtype=torch.bfloat16)
    descs = (bshd_descriptor(q, gb.BLOCK_M), bshd_descriptor(q, gb.BLOCK_N), bshd_descriptor(q, gb.BLOCK_N),
             bshd_descriptor(q, gb.BLOCK_M))
    acc = torch.empty(56 * 67 * gb.BLOCK_M, gb.HEAD_DIM)
    acc_desc = gb.TensorDescriptor(acc, list(acc.shape), list(acc.stride()), [gb.BLOCK_M, gb.CHUNK],
                                   gb.gl.NVMMASharedLayout.get_default_for([gb.BLOCK_M, gb.CHUNK], gb.gl.float32))
    names = ("q_desc", "k_desc", "v_desc", "do_desc", "acc_desc")
    sig = dict(zip(names, map(mangle_type, descs + (acc_desc,))))
    sig.update(Lse2="*fp32", Delta="*fp32", dK="*bf16", dV="*bf16", Turns="*i32",
               seq="i32", heads="i32", heads_total="i32", kv_blocks="i32", head_group="i32", qk_scale="fp32",
               sm_scale="fp32", stride_gb="i32", stride_gs="i32", stride_gh="i32")
    consts = dict(BLOCK_M=gb.BLOCK_M, BLOCK_N=gb.BLOCK_N, D=gb.HEAD_DIM, HALF_N=gb.HALF_N, CHUNK=gb.CHUNK,
                  RING=gb.RING, COMPUTE_REGS=gb.COMPUTE_REGS, AGENT_REGS=gb.AGENT_REGS, DIAG=0,
                  LATE=gb.LATE_TERM, num_warps=gb.COMPUTE_WARPS)
    sig.update(dict.fromkeys(consts, "constexpr"))
    compiled, ptx, info = compile_gluon_sm90(gb._attention_bwd_one_pass_kernel.kernel, sig, consts, gb.COMPUTE_WARPS)
    registers = sorted(set(map(int, re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+);", ptx))))
    print(json.dumps({"wgmma": sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.\w+\.f32\.\w+\.\w+", ptx))),
                      "shared_bytes": compiled.metadata.shared,
                      "spill_bytes": sum(map(int, re.findall(r"(\d+) bytes spill", info))),
                      "setmaxnreg": registers,
                      "turn_acquire": "ld.acquire.gpu.global.b32" in ptx,
                      "fold_adds": sorted(set(re.findall(r"cp\.reduce\.async\.bulk\.tensor\.[\w:.]+", ptx))),
                      "turn_release_after_completion": bool(re.search(
                          r"cp\.async\.bulk\.wait_group 0;[^\n]*fence\.acq_rel\.gpu;[^\n]*st\.relaxed\.gpu", ptx)),
                      "wgmma_serialized": "wgmma.mma_async instructions are serialized" in info,
                      "wgmma_wait_injected": "warpgroup.wait is injected" in info,
                      "registers": sorted(set(map(int, re.findall(r"Used (\d+) registers", info))))}))


if __name__ == "__main__":
    main()
