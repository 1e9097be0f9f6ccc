"""Compile flowlock.ops.linear.gluon's kernel for sm90 on this machine (Triton's pipeline to PTX, no GPU)
and print, as JSON, the wgmma instructions and the barriers over the consumer's warps its PTX holds.
Run by test_linear_gluon_compiled.py in a subprocess with the interpreter off."""

import json
import re

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.runtime.jit import mangle_type

from flowlock.ops.linear import gluon as lg


def main() -> None:
    x = torch.empty(925, 7168, dtype=torch.bfloat16)
    weight = torch.empty(5376, 7168, dtype=torch.bfloat16)
    out = torch.empty(925, 5376, dtype=torch.bfloat16)
    sig = dict(zip(("a_desc", "b_desc", "c_desc"), map(mangle_type, lg.descriptors(x, weight, out))))
    sig.update(I="i32", J="i32", R="i32")
    consts = dict(BLOCK_I=lg.BLOCK_I, BLOCK_J=lg.BLOCK_J, BLOCK_R=lg.BLOCK_R, GROUP_I=lg.GROUP_I, STAGES=lg.STAGES,
                  NUM_PROGRAMS=132, LOADER_WARPS=lg.LOADER_WARPS, LOADER_REGS=lg.LOADER_REGS, num_warps=lg.WARPS)
    sig.update(dict.fromkeys(consts, "constexpr"))
    compiled = triton.compile(gluon._runtime.GluonASTSource(lg._linear_fwd_ws_kernel, sig, consts, {}),
                              target=GPUTarget("cuda", 90, 128), options={"num_warps": lg.WARPS})
    ptx = compiled.asm["ptx"]
    print(json.dumps({"wgmma": sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.\w+\.f32\.bf16\.bf16", ptx))),
                      "partition_barriers": len(re.findall(r"bar\.sync\s+\d+,\s*256;", ptx)),
                      "shared_bytes": compiled.metadata.shared}))


if __name__ == "__main__":
    main()
