"""``tools/exact_dp_nccl.py`` on CPU (tiny H3, gloo, 2 ranks through torchrun): the exact FSDP2 step's
52 parameter gradients equal the one-process tree, the report names every variant and its time."""

import json
import os
import subprocess
import sys
from pathlib import Path

from flowlock.parallel.ports import free_local_port

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "exact_dp_nccl.py"




def test_tiny_exact_dp2_step_equals_one_process(tmp_path):
    out = tmp_path / "dp2.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(free_local_port()), str(SCRIPT), "--tiny", "--device", "cpu", "--repeats", "1",
               "--out", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["degree"] == 2 and report["micro_batches_per_rank"] == 2
    exact = report["variants"]["exact"]
    assert report["exact_equals_one_gpu"] and exact["equal"] == exact["parameters"] == 52
    assert exact["differing_elements"] == 0
    assert all(report["variants"][v]["step_ms"] > 0 for v in ("exact", "fsdp2", "stock"))
