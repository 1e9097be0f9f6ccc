"""Compile flowlock.ops.linear.gluon_stream's kernel for sm90 on this machine (Triton's pipeline to PTX, no
GPU) for q's forward at M = 925 with bias, and print, as JSON: the wgmma instructions, its shared
memory, ptxas's registers and spill bytes, and the PTX's atomics and acquire loads (the ticket, the
head's release, the tail's acquire spin). Run by test_linear_gluon_stream_compiled.py in a subprocess
with the interpreter off."""

import json
import re

import torch
from compile_probe import compile_gluon_sm90
from triton.runtime.jit import mangle_type

from flowlock.config import launch_config
from flowlock.ops.linear import gluon as lg
from flowlock.ops.linear import gluon_stream as gs

BF16 = torch.bfloat16


def main() -> None:
    cfg = launch_config("linear_fwd", BF16, "sm90", (7168, 5376)).with_blocks(STREAM_PANELS=1)
    a, b, c = (torch.empty(925, 5376, dtype=BF16), torch.empty(7168, 5376, dtype=BF16),
               torch.empty(925, 7168, dtype=BF16))
    sig = dict(zip(("a_desc", "b_desc", "c_desc"), map(mangle_type, lg.descriptors(a, b, True, c, cfg)[:3])))
    sig.update(bias_ptr="*bf16", chain_ptr="*fp32", flags="*i32", I="i32", J="i32", R="i32", groups="i32")
    consts = dict(HAS_BIAS=True, BLOCK_I=cfg["BLOCK_I"], BLOCK_J=cfg["BLOCK_J"], BLOCK_R=cfg["BLOCK_R"],
                  RING=cfg["RING"], LOADER_WARPS=gs.LOADER_WARPS, LOADER_REGS=gs.LOADER_REGS, num_warps=cfg.num_warps)
    sig.update(dict.fromkeys(consts, "constexpr"))
    compiled, ptx, info = compile_gluon_sm90(gs._linear_fwd_stream_kernel.kernel, sig, consts, cfg.num_warps)
    print(json.dumps({"wgmma": sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.\w+\.f32\.bf16\.bf16", ptx))),
                      "shared_bytes": compiled.metadata.shared, "config_shared_bytes": lg.shared_bytes(cfg),
                      "registers": int(re.search(r"Used (\d+) registers", info).group(1)),
                      "spill_bytes": sum(map(int, re.findall(r"(\d+) bytes spill", info))),
                      "atomics": sorted(set(re.findall(r"atom\.global\.[\w.]+", ptx))),
                      "acquire_loads": len(re.findall(r"ld\.global\.gpu\.acquire", ptx))}))


if __name__ == "__main__":
    main()
