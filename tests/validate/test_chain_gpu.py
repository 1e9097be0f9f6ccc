"""GPU re-check of the chain replay and the strict trace on the tiny H3 (H200: ``pytest -m gpu``)."""

import pytest
import torch

from flowlock.models.minimax_h3.tiny import tiny_h3
from flowlock.validate.chain import chain_replay

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return tiny_h3(device="cuda")


def test_chain_on_gpu_strict_is_pure_and_sinusoid_bitwise_diffusers(model):
    report = chain_replay(model, repeats=5)
    assert all(b.endswith(":triton") for b in report["backends"])
    for stage in report["flowlock"]["stages"]:
        assert stage["repeat_equal"] and stage["invariant"], stage
    assert report["ok"]
    sinusoid = next(s for s in report["flowlock"]["stages"] if s["stage"] == "timestep_sinusoid")
    assert sinusoid["chained_vs_provider"]


def test_strict_trace_on_gpu_finds_no_divergence(model):
    from flowlock.validate.batch_trace import run_traces

    assert run_traces(model)["strict"]["divergence"] is None
