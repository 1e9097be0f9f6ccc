"""Compile flowlock.ops.linear.gluon_dw's kernel for sm90 on this machine (Triton's pipeline to PTX, no
GPU) under the frozen sm90 bf16 dW tile with GLUON set, and print, as JSON: the wgmma instructions, the
barriers over the consumer's warps, its shared memory and, from the bundled ptxas, its registers and
spill bytes. Run by test_linear_gluon_dw_compiled.py in a subprocess with the interpreter off."""

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

from flowlock.config import launch_config
from flowlock.ops.linear import gluon_dw

BF16 = torch.bfloat16


def main() -> None:
    cfg = launch_config("linear_dw", BF16, "sm90", (7168, 5376)).with_blocks(GLUON=1, RING=2)
    dy, x, c = torch.empty(4253, 7168, dtype=BF16), torch.empty(4253, 5376, dtype=BF16), torch.empty(7168, 5376,
                                                                                                     dtype=BF16)
    sig = dict(zip(("a_desc", "b_half_desc", "c_half_desc"), map(mangle_type, gluon_dw.descriptors(dy, x, c, cfg))))
    sig.update(I="i32", J="i32", R="i32")
    consts = dict(UNIT=cfg["UNIT"], BLOCK_I=cfg["BLOCK_I"], BLOCK_J=cfg["BLOCK_J"], BLOCK_R=cfg["BLOCK_R"],
                  GROUP_I=cfg["GROUP_I"], RING=cfg["RING"], NUM_PROGRAMS=132, LOADER_WARPS=gluon_dw.LOADER_WARPS,
                  LOADER_REGS=gluon_dw.LOADER_REGS, num_warps=cfg.num_warps)
    sig.update(dict.fromkeys(consts, "constexpr"))
    compiled = triton.compile(gluon._runtime.GluonASTSource(gluon_dw._linear_dw_ws_kernel, sig, consts, {}),
                              target=GPUTarget("cuda", 90, 128), options={"num_warps": cfg.num_warps})
    ptx = compiled.asm["ptx"]
    ptxas = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        pathlib.Path(src).write_text(ptx)
        info = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", src, "-o", os.path.join(tmp, "k.o")],
                              capture_output=True, text=True, check=True).stderr
    print(json.dumps({"wgmma": sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.\w+\.f32\.bf16\.bf16", ptx))),
                      "partition_barriers": len(re.findall(r"bar\.sync\s+\d+,\s*256;", ptx)),
                      "shared_bytes": compiled.metadata.shared, "config_shared_bytes": gluon_dw.shared_bytes(cfg),
                      "registers": int(re.search(r"Used (\d+) registers", info).group(1)),
                      "spill_bytes": sum(map(int, re.findall(r"(\d+) bytes spill", info)))}))


if __name__ == "__main__":
    main()
