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


def compile_gluon_sm90(kernel, sig: dict, consts: dict, num_warps: int):
    """``(compiled, ptx, ptxas_info)`` of Gluon ``kernel`` (the ``@gluon.jit`` function) for sm90 with
    ``sig`` (argument types, constexprs included) and ``consts``; ``ptxas_info`` is the bundled
    ptxas's ``-v`` report for sm_90a (registers, spills). Needs ``TRITON_INTERPRET`` unset."""
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental import gluon

    compiled = triton.compile(gluon._runtime.GluonASTSource(kernel, sig, consts, {}),
                              target=GPUTarget("cuda", 90, 128), options={"num_warps": num_warps})
    ptx = compiled.asm["ptx"]
    ptxas = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        pathlib.Path(src).write_text(ptx)
        info = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", src, "-o", os.path.join(tmp, "k.o")],
                              capture_output=True, text=True, check=True).stderr
    return compiled, ptx, info
