"""Compile flowlock.ops.attention.gluon_fwd's kernel for sm90 on this machine (Triton's pipeline to PTX,
no GPU) for H3's attention (56 heads of 128, bf16), with and without ping-pong, and print, as JSON per
variant: the wgmma instructions and the wait depths, its shared memory, ptxas's registers, spill bytes and
wgmma warnings, and the register counts its partitions set. Run by test_attention_gluon_fwd_compiled.py
in a subprocess with the interpreter off."""

import json
import re

import torch
from compile_probe import compile_gluon_sm90
from triton.runtime.jit import mangle_type

from flowlock.ops.attention import gluon_fwd as gf


def probe(pingpong: bool) -> dict:
    q = torch.empty(1, 4253, 56, 128, dtype=torch.bfloat16)
    sig = dict(zip(("q_desc", "k_desc", "v_desc"), map(mangle_type, gf.descriptors(q, q, q))))
    sig.update(Out="*bf16", Lse2="*fp32", seq="i32", heads="i32", qk_scale="fp32", stride_ob="i32", stride_os="i32",
               stride_oh="i32")
    consts = dict(HALF=gf.HALF, BLOCK_N=gf.BLOCK_N, D=gf.HEAD_DIM, RING=gf.RING, HALF_WARPS=gf.HALF_WARPS,
                  HALF_REGS=gf.HALF_REGS, LOADER_WARPS=gf.LOADER_WARPS, LOADER_REGS=gf.LOADER_REGS,
                  PINGPONG=pingpong, num_warps=gf.HALF_WARPS)
    sig.update(dict.fromkeys(consts, "constexpr"))
    compiled, ptx, info = compile_gluon_sm90(gf._attention_fwd_ws_kernel.kernel, sig, consts, gf.HALF_WARPS)
    return {"wgmma": sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.\w+\.f32\.bf16\.bf16", ptx))),
            "wgmma_wait_groups": sorted(set(map(int, re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+);", ptx)))),
            "shared_bytes": compiled.metadata.shared,
            "spill_bytes": sum(map(int, re.findall(r"(\d+) bytes spill", info))),
            "setmaxnreg": sorted(set(map(int, re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+);", ptx)))),
            "named_barriers": bool(re.search(r"bar\.(?:sync|arrive) %r\d+, 256;", ptx)),
            "wgmma_serialized": "wgmma.mma_async instructions are serialized" in info,
            "wgmma_wait_injected": "warpgroup.wait is injected" in info,
            "registers": sorted(set(map(int, re.findall(r"Used (\d+) registers", info))))}


def main() -> None:
    print(json.dumps({"plain": probe(False), "pingpong": probe(True)}))


if __name__ == "__main__":
    main()
