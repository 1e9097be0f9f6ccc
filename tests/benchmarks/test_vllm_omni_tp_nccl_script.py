"""``tools/vllm_omni_tp_nccl.py`` on CPU (tiny H3 with 8 heads, gloo, TP 2 and Ulysses 2 through torchrun, the real
vLLM-Omni classes in vLLM's own distributed state): every rank's flowlock velocities equal the one-process
diffusers strict ones, the stock TP path's are shown to differ (so the comparison can fail), and every
rank reports the three forwards' times."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flowlock.parallel.ports import free_local_port

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "vllm_omni_tp_nccl.py"




@pytest.mark.parametrize("layout", ["tp", "ulysses"])
def test_tiny_degree2_forward_equals_one_process_on_every_rank(tmp_path, layout):
    out = tmp_path / f"{layout}2.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(free_local_port()), str(SCRIPT), "--tiny", "--device", "cpu", "--iters", "1",
               "--warmup", "0", "--out", str(out), *(["--sp"] if layout == "ulysses" else [])]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["layout"] == layout and report["degree"] == 2 and report["backend"] == "gloo"
    assert len(report["ranks"]) == 2
    assert report["all_ranks_bitwise_equal_to_one_gpu"]
    for rank in report["ranks"]:
        assert "error" not in rank, rank
        assert rank["flowlock_degree"] == 2, rank
        assert rank["flowlock_parallel_mismatches"] == {"video": 0, "audio": 0}, rank
        assert sum(rank["stock_parallel_mismatches"].values()) > 0, rank
        assert rank["rows_padded"] % 64 == 0 and rank["rows_used"] < rank["rows_padded"]
        assert {n: r["median_ms"] > 0 for n, r in rank["forward_ms"].items()} == dict.fromkeys(
            ("one_gpu", "flowlock_parallel", "stock_parallel"), True)
