"""Run an offline-compile probe (a script in this folder that compiles kernels for sm90 with Triton's
own pipeline, no GPU, and prints its findings as JSON on its last line) in a subprocess with the
interpreter off, as the compiler would see the kernels on a GPU host."""

import json
import os
import pathlib
import subprocess
import sys


def run_compile_probe(name: str, timeout: int = 900) -> dict:
    """The JSON a probe ``name`` (a file next to this one) prints last; fails the test with the probe's
    stderr tail when it exits non-zero."""
    probe = pathlib.Path(__file__).resolve().parent / name
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(probe)], env=env, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])
