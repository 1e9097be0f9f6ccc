"""``tools/h200_full_depth_checks.py`` on CPU (tiny H3, reference backend): its repeatability and
batch-invariance checks run end to end, compare every parameter gradient and pass on the strict path."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "h200_full_depth_checks.py"


def test_tiny_run_is_repeatable_and_batch_invariant(tmp_path):
    out = tmp_path / "checks.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--layers", "3", "--refiner-layers", "1",
                           "--device", "cpu", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    rep = report["repeatability"]
    assert rep["outputs_and_latent_grads_repeatable"] and rep["param_grads_repeatable"] == rep["param_grads"] > 50
    assert report["batch_invariance"]["sample0_alone_equals_in_batch_of_2"]
    assert report["config"]["num_layers"] == 3 and report["gradient_checkpointing"]
