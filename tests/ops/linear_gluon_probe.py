"""Compile flowlock.ops.linear.gluon's kernel for sm90 on this machine (Triton's pipeline to PTX, no GPU)
for the forward (B stored transposed, with bias) and dX (B as stored) under the frozen sm90 bf16 tile
with GLUON set, and print, as JSON, per product: the wgmma instructions, the barriers over the
consumer's warps its PTX holds and its shared memory. Run by test_linear_gluon_compiled.py in a
subprocess with the interpreter off."""

import json
import re

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.runtime.jit import mangle_type

from flowlock.config import launch_config
from flowlock.ops.linear import gluon as lg

BF16 = torch.bfloat16


def compile_product(b_t: bool) -> dict:
    cfg = launch_config("linear_fwd" if b_t else "linear_dx", BF16, "sm90", (7168, 5376)).with_blocks(GLUON=1, RING=3)
    a = torch.empty(925, 5376 if b_t else 7168, dtype=BF16)
    b = torch.empty(7168, 5376, dtype=BF16)
    c = torch.empty(925, 7168 if b_t else 5376, dtype=BF16)
    names = ("a_desc", "b_desc", "c_desc", "b_half_desc", "c_half_desc")
    sig = dict(zip(names, map(mangle_type, lg.descriptors(a, b, b_t, c, cfg))))
    sig.update(bias_ptr="*bf16", I="i32", J="i32", R="i32")
    consts = dict(B_T=b_t, HAS_BIAS=b_t, TAIL_SPLIT=True, BLOCK_I=cfg["BLOCK_I"], BLOCK_J=cfg["BLOCK_J"],
                  BLOCK_R=cfg["BLOCK_R"], GROUP_I=cfg["GROUP_I"], RING=cfg["RING"], NUM_PROGRAMS=132,
                  LOADER_WARPS=lg.LOADER_WARPS, LOADER_REGS=lg.LOADER_REGS, num_warps=cfg.num_warps)
    sig.update(dict.fromkeys(consts, "constexpr"))
    compiled = triton.compile(gluon._runtime.GluonASTSource(lg._linear_gemm_ws_kernel.kernel, sig, consts, {}),
                              target=GPUTarget("cuda", 90, 128), options={"num_warps": cfg.num_warps})
    ptx = compiled.asm["ptx"]
    return {"wgmma": sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.\w+\.f32\.bf16\.bf16", ptx))),
            "partition_barriers": len(re.findall(r"bar\.sync\s+\d+,\s*256;", ptx)),
            "shared_bytes": compiled.metadata.shared, "config_shared_bytes": lg.shared_bytes(cfg)}


def main() -> None:
    print(json.dumps({"forward": compile_product(True), "dx": compile_product(False)}))


if __name__ == "__main__":
    main()
