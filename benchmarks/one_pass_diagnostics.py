"""Where the one-pass Gluon attention backward's time goes: its variants against the separate kernels it
replaced (the chained dQ, ``bench_attention.separate_configs``), the frozen backward and cuDNN's backward
in one process (56 heads x 128, bf16, batch 1; queued medians of 10,
alternating order). Prints one JSON row per sequence length.

Variants (``gluon_bwd.attention_bwd_one_pass`` arguments): ``ordL`` stores the dQ term at
``LATE_TERM = L`` (0 after its product, 1 under the next block's S^T product); ``_gG`` tickets in
groups of G heads (``ord1`` at every G, at every S: one grouping must serve them all); the diagnostic
switches (wrong bits by design) ``_notma`` (DIAG 4: the term stored to shared memory, never sent to
the TMA unit), ``_readpass`` (DIAG 5: turns passed once the TMA unit has read the term, FA3's
protocol), ``_nofold`` (DIAG 1: no term store, no traffic). ``bits_dq_dk_dv`` compares each ordered
variant with ``ord0`` bit for bit (they compute the same sums). The bits against the separate
kernels are the GPU test's (``tests/ops/test_attention_gluon_bwd_gpu.py``).

    PYTHONPATH=src TRITON_INTERPRET=0 python benchmarks/one_pass_diagnostics.py [--skip-gate] [--baseline FILE]

``--baseline FILE`` also times another version of ``gluon_bwd.py`` (``base_gG``, its default order) in
the same process, e.g. the measured kernel from ``git show e364a1b:src/flowlock/ops/attention/gluon_bwd.py``;
its bits are compared with ``ord0`` too.

It refuses to time a kernel whose GPU bits test fails (the gate; ``--skip-gate`` when it just ran).
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from bench_attention import alternating_medians, bitwise, inputs, sdpa, separate_configs
from torch.nn.attention import SDPBackend

from flowlock.ops.attention import gluon_bwd
from flowlock.ops.attention.triton import attention_bwd, attention_fwd

ROOT = Path(__file__).resolve().parents[1]
# every ticket grouping at every length (one grouping must serve every S); the diagnostics at the
# grouping measured best at that S (38cafee on an H200, c12df11 on an H100)
GROUPS = (1, 2, 4, 8, 16)
SEQS_AND_DIAG_GROUP = ((4253, 4), (16384, 1), (925, 8))


def row(seq: int, g0: int, baseline=None, groups: tuple[int, ...] = GROUPS, iters: int = 10) -> dict:
    q, k, v, do = inputs(1, seq, 56, 128, seed=seq)
    scale = 128 ** -0.5
    with torch.no_grad():
        out, lse2 = attention_fwd(q, k, v, scale)
    delta = (do.float() * out.float()).sum(-1).transpose(1, 2).contiguous()
    cudnn_out = sdpa(SDPBackend.CUDNN_ATTENTION, q, k, v)
    qd, kd, vd, dod = (t.detach() for t in (q, k, v, do))

    def one_pass(group: int, diag: int, late: int):
        return lambda: gluon_bwd.attention_bwd_one_pass(qd, kd, vd, dod, lse2, delta, scale, group, diag, late)

    dkdv, _, chained_dq = separate_configs(128)
    fns = {"frozen": lambda: attention_bwd(dod, qd, kd, vd, out, lse2, scale),
           "separate_chained": lambda: attention_bwd(dod, qd, kd, vd, out, lse2, scale, dkdv, chained_dq),
           "cudnn": lambda: torch.autograd.grad(cudnn_out, (q, k, v), do, retain_graph=True),
           **{f"ord1_g{g}": one_pass(g, 0, 1) for g in groups},
           f"ord0_g{g0}": one_pass(g0, 0, 0),
           f"ord1_g{g0}_notma": one_pass(g0, 4, 1),
           f"ord1_g{g0}_readpass": one_pass(g0, 5, 1),
           f"ord1_g{g0}_nofold": one_pass(g0, 1, 1),
           f"ord0_g{g0}_nofold": one_pass(g0, 1, 0)}
    if baseline is not None:
        fns.update({f"base_g{g}": (lambda g=g: baseline.attention_bwd_one_pass(qd, kd, vd, dod, lse2, delta, scale, g))
                    for g in groups})
    ref = fns[f"ord0_g{g0}"]()
    ordered = [f"ord1_g{g}" for g in groups] + [n for n in fns if n.startswith("base_")]
    bits = {n: [bitwise(x, y) for x, y in zip(fns[n](), ref)] for n in ordered}
    ms = alternating_medians(fns, iters, 2, queued=True)
    return {"seq": seq, "bits_dq_dk_dv": bits, "ms": ms,
            "over_separate_chained": {n: round(t / ms["separate_chained"], 4) for n, t in ms.items()},
            "over_cudnn": {n: round(t / ms["cudnn"], 4) for n, t in ms.items()}}


def run_gate() -> None:
    env = dict(os.environ, TRITON_INTERPRET="0")
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/ops/test_attention_gluon_bwd_gpu.py"]
    if subprocess.run(cmd, cwd=ROOT, env=env).returncode != 0:
        sys.exit("test gate failed: refusing to benchmark")


def load_baseline(path: str):
    spec = importlib.util.spec_from_file_location("gluon_bwd_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    args = sys.argv[1:]
    if "--skip-gate" not in args:
        run_gate()
    baseline = load_baseline(args[args.index("--baseline") + 1]) if "--baseline" in args else None
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for seq, g0 in SEQS_AND_DIAG_GROUP:
        print(json.dumps(row(seq, g0, baseline)), flush=True)
        torch.cuda.empty_cache()
