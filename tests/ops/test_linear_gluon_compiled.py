"""The Gluon forward candidate (flowlock.ops.linear.gluon) compiles for sm90 on a CPU host: its PTX issues
the m64 n256 k16 wgmma the Triton kernel's tile issues, synchronizes the consumer's 8 warps before each
stage release, and fits an sm90 program's shared memory. Whether it keeps the Triton kernel's bits is a
GPU test (test_linear_gluon_gpu.py)."""

import json
import os
import pathlib
import subprocess
import sys

PROBE = pathlib.Path(__file__).resolve().parent / "linear_gluon_probe.py"


def test_gluon_forward_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(PROBE)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert found["wgmma"] == ["wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16"], found
    assert found["partition_barriers"] >= 1, found
    assert found["shared_bytes"] <= 232448, found
