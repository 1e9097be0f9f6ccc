"""capture_h3 on the CPU: what it refuses before anything runs (sharded or context-parallel models,
missing or invalid model inputs, CPU tensors). The capture and replays themselves are GPU tests
(test_h3_graphed_gpu.py)."""

import types

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

from flowlock.models.minimax_h3 import tiny_h3, tiny_inputs
from flowlock.models.minimax_h3.graphed import LAYOUT_INPUTS, capture_h3, validate_inputs


def _never(**inputs):
    pytest.fail("a refused capture ran the call")


def test_sharded_or_context_parallel_models_are_refused():
    model = tiny_h3()
    inputs = tiny_inputs(1)
    block = model.transformer_blocks[0]
    block.__class__ = type("FSDPMiniMaxH3TransformerBlock", (FSDPModule, type(block)), {})
    with pytest.raises(ValueError, match="FSDP2"):
        capture_h3(model, _never, inputs)
    model = tiny_h3()
    model._parallel_config = types.SimpleNamespace(context_parallel_config=object())
    with pytest.raises(ValueError, match="context parallelism"):
        capture_h3(model, _never, inputs)


def test_inputs_are_checked_as_the_strict_forward_checks_them():
    inputs = tiny_inputs(1)
    validate_inputs(inputs)
    with pytest.raises(ValueError, match="missing: timestep"):
        validate_inputs({k: v for k, v in inputs.items() if k != "timestep"})
    with pytest.raises(ValueError, match="timestep values must lie in"):
        validate_inputs({**inputs, "timestep": torch.tensor([0.2, 1.5])})
    with pytest.raises(ValueError, match="video_indices"):
        validate_inputs({**inputs, "video_indices": inputs["video_indices"] + 100})
    with pytest.raises(ValueError, match="CUDA tensor"):
        capture_h3(tiny_h3(), _never, inputs)
    assert set(LAYOUT_INPUTS) < set(inputs)
