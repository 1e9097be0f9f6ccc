"""``tools/ulysses_nccl.py --tiny`` on CPU (tiny H3, gloo, Ulysses 2 through torchrun): every rank's
outputs and latent gradients equal one process at an even and an odd S; stock diffusers Ulysses differs at
the even S (so the comparison can fail) and refuses the odd one, which the report records."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flowlock.parallel.ports import free_local_port

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "ulysses_nccl.py"




@pytest.mark.parametrize("seq", [24, 25])
def test_tiny_ulysses2_equals_one_process(tmp_path, seq):
    out = tmp_path / "ulysses.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(free_local_port()), str(SCRIPT), "--tiny", "--seq", str(seq), "--repeats", "1",
               "--out", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["degree"] == 2 and report["seq"] == seq and report["bitwise_equal"]
    for rank in report["ranks"]:
        assert set(rank["mismatches"]) == {"sample", "audio_sample", "grad:hidden_states",
                                           "grad:audio_hidden_states", "grad:encoder_hidden_states"}
        assert not any(rank["mismatches"].values()), rank
        assert rank["one_gpu_ms"] > 0 and rank["ulysses_ms"] > 0 and rank["stock_one_gpu_ms"] > 0
        if seq % 2:
            assert "divisible" in rank["stock_ulysses_error"], rank
        else:
            assert sum(rank["stock_mismatches_vs_one_gpu_strict"].values()) > 0 and rank["stock_ulysses_ms"] > 0
