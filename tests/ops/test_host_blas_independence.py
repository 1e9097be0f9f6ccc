"""The interpreted kernels' bits must not depend on which BLAS kernel the host CPU selects.

Under ``TRITON_INTERPRET=1`` Triton's ``tl.dot`` is ``numpy.matmul``, and numpy's OpenBLAS picks its
sgemm kernel by CPU at load time (``OPENBLAS_CORETYPE`` overrides the choice). The Haswell / Zen
kernel, which AVX2-only CPUs select, makes a row's bits depend on its position in the tile, so a
batch-invariance test passed or failed depending on the machine CI landed on. Every kernel this CPU
can run is exercised here in a subprocess: the probe shows the hazard is real there (Triton's own
``tl.dot`` is position-dependent under Haswell and Zen) and that flowlock's product is not, and the
invariance tests that reach a tile product pass under each kernel.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

TESTS = pathlib.Path(__file__).resolve().parent.parent
# "" keeps the machine's own choice (and any OPENBLAS_CORETYPE the host sets for itself).
CORETYPES = ("", "Haswell", "Zen", "Sandybridge")
# The kernel family OpenBLAS reports for a requested core type: numpy's build runs Zen on its
# Haswell kernels and reports them as such.
REPORTED_AS = {"Haswell": ("Haswell",), "Zen": ("Zen", "Haswell"), "Sandybridge": ("Sandybridge",)}
# The interpreter-based invariance tests whose kernels reach a tile product (linear, adaln,
# final_adaln, attention), forward and backward.
INVARIANCE_SUBSET = (
    "ops/test_adaln.py::test_d_temb_rows_are_pure",
    "ops/test_adaln.py::test_rows_pure_across_row_tiles",
    "ops/test_linear.py::test_batch_invariance",
    "ops/test_final_adaln_invariance.py::test_dx_batch_invariant",
    "ops/test_attention.py::test_batch_invariant_forward_and_grads",
)


def _env(coretype: str) -> dict:
    env = dict(os.environ)
    if coretype:
        env["OPENBLAS_CORETYPE"] = coretype
    return env


@pytest.mark.parametrize("coretype", CORETYPES)
def test_interpreted_tile_product_is_position_independent_under_each_openblas_kernel(coretype):
    probe = subprocess.run([sys.executable, str(TESTS / "ops" / "openblas_position_probe.py")], env=_env(coretype),
                           capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, probe.stderr[-4000:]
    result = json.loads(probe.stdout.strip().splitlines()[-1])
    if coretype:
        assert result["core"] in REPORTED_AS[coretype], f"OpenBLAS ignored OPENBLAS_CORETYPE={coretype}: {result}"
    if result["core"] in ("Haswell", "Zen"):
        assert result["tl_dot_position_dependent"], f"the planted hazard did not show under {result['core']}"
    assert not result["dot_f32_position_dependent"], result


@pytest.mark.parametrize("coretype", CORETYPES)
def test_invariance_tests_pass_under_each_openblas_kernel(coretype):
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
                          "-W", "ignore::DeprecationWarning", *INVARIANCE_SUBSET],
                         cwd=TESTS, env=_env(coretype), capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, f"OPENBLAS_CORETYPE={coretype or '(default)'}:\n{run.stdout[-6000:]}"
