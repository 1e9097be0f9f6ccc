"""Compile flowlock.ops.attention.gluon_fwd's kernel for sm90 on this machine (Triton's pipeline to PTX,
no GPU) for H3's attention (56 heads of 128, bf16) and print, as JSON: the wgmma instructions, its
shared memory, ptxas's registers and spill bytes, and the register counts its partitions set. Run by
test_attention_gluon_fwd_compiled.py in a subprocess with the interpreter off."""

import json
import os
import pathlib
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.runtime.jit import mangle_type

from flowlock.ops.attention import gluon_fwd as gf


def main() -> None:
    q = torch.empty(1, 4253, 56, 128, dtype=torch.bfloat16)
    sig = dict(zip(("q_desc", "k_desc", "v_desc"), map(mangle_type, gf.descriptors(q, q, q))))
    sig.update(Out="*bf16", Lse2="*fp32", seq="i32", heads="i32", qk_scale="fp32", stride_ob="i32", stride_os="i32",
               stride_oh="i32")
    consts = dict(HALF=gf.HALF, BLOCK_N=gf.BLOCK_N, D=gf.HEAD_DIM, RING=3, HALF_WARPS=gf.HALF_WARPS,
                  HALF_REGS=gf.HALF_REGS, LOADER_WARPS=gf.LOADER_WARPS, LOADER_REGS=gf.LOADER_REGS,
                  num_warps=gf.HALF_WARPS)
    sig.update(dict.fromkeys(consts, "constexpr"))
    compiled = triton.compile(gluon._runtime.GluonASTSource(gf._attention_fwd_ws_kernel, sig, consts, {}),
                              target=GPUTarget("cuda", 90, 128), options={"num_warps": gf.HALF_WARPS})
    ptx = compiled.asm["ptx"]
    ptxas = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        pathlib.Path(src).write_text(ptx)
        info = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", src, "-o", os.path.join(tmp, "k.o")],
                              capture_output=True, text=True, check=True).stderr
    registers = sorted(set(map(int, re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+);", ptx))))
    print(json.dumps({"wgmma": sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.\w+\.f32\.bf16\.bf16", ptx))),
                      "shared_bytes": compiled.metadata.shared,
                      "spill_bytes": sum(map(int, re.findall(r"(\d+) bytes spill", info))),
                      "setmaxnreg": registers}))


if __name__ == "__main__":
    main()
