"""The reference ops' CPU bits must not depend on where a row sits in its tensor, on any ATen CPU
capability this host runs.

ATen evaluates ``exp2``, SiLU, ``sigmoid`` and ``rsqrt`` with a vector routine over a tensor's body
and a scalar one over its tail, which differ in the last float32 bit. A float32 evaluation inside a
reference op therefore made a row's bits depend on its neighbours, and whether a test saw it depended
on the vector width: the fp32 vLLM-Omni packed-vs-alone test passed on an AVX2 host and failed on an
AVX-512 one. The probe runs under each capability (``ATEN_CPU_CAPABILITY``) in a subprocess: the
hazard must show under AVX2 (so the probe can see it) and no reference op may show it.
"""

import json
import pathlib
import subprocess
import sys

import pytest
import torch

PROBE = pathlib.Path(__file__).resolve().parent / "elementwise_position_probe.py"
_ORDER = ("default", "avx2", "avx512")
# Every x86 capability up to the one this CPU runs; "default" alone on any other CPU.
_HOST = torch.backends.cpu.get_cpu_capability().lower()
CAPABILITIES = _ORDER[:max((i for i, c in enumerate(_ORDER) if _HOST.startswith(c)), default=0) + 1]


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_reference_ops_are_position_free(capability):
    env = {**__import__("os").environ, "ATEN_CPU_CAPABILITY": capability}
    probe = subprocess.run([sys.executable, str(PROBE)], env=env, capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, probe.stderr[-4000:]
    result = json.loads(probe.stdout.strip().splitlines()[-1])
    assert result["capability"].lower().startswith(capability), result
    if capability == "avx2":
        assert any(result["hazard"].values()), f"the fp32 tail/body hazard did not show under AVX2: {result}"
    assert not any(result["references"].values()), result
