"""Regressions found by running diffusers' own H3 test file with every model strict-patched
(tools/diffusers_h3_suite.sh, docs/diffusers_suite.md), reproduced on the tiny H3."""

import pytest
import torch
from h3_helpers import LATENTS, batch_fn, forward_backward

import flowlock
from flowlock.models.minimax_h3 import make_h3, tiny_h3, tiny_inputs
from flowlock.models.minimax_h3.golden import golden_inputs, golden_model
from flowlock.models.minimax_h3.tiny import TINY_H3_CONFIG
from flowlock.testing import assert_batch_invariant, assert_within_budget

# diffusers' test model embeds the timestep in 8 channels (freq_dim=8), not H3's 256: strict mode
# used to refuse every forward of it ("timestep_sinusoid serves Timesteps(256, True, 0) only").
NARROW = dict(TINY_H3_CONFIG, freq_dim=8)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_narrow_timestep_embedding_within_golden_budget(dtype):
    stock, model = make_h3(NARROW, dtype=dtype), make_h3(NARROW, dtype=dtype)
    inputs = tiny_inputs(2, seed=3, config=NARROW)
    golden_out, golden_grads = forward_backward(golden_model(stock), golden_inputs(inputs), input_grad=True)
    eager_out, eager_grads = forward_backward(stock, inputs, input_grad=True)
    with flowlock.patch(model, mode="strict"), flowlock.mode("strict") as frame:
        strict_out, strict_grads = forward_backward(model, inputs, input_grad=True)
    assert "timestep_sinusoid" in {op for op, _ in frame.ran}
    for name, actual, golden, eager in zip(("sample", "audio_sample"), strict_out, golden_out, eager_out):
        assert_within_budget(actual, golden, baseline=eager, what=f"freq_dim 8 {name}")
    assert strict_grads.keys() == golden_grads.keys()
    for name, golden in golden_grads.items():
        assert_within_budget(strict_grads[name], golden, baseline=eager_grads[name], what=f"freq_dim 8 grad {name}")


def test_narrow_timestep_embedding_batch_invariant():
    model = make_h3(NARROW)
    inputs = tiny_inputs(3, seed=1, config=NARROW)
    with flowlock.patch(model, mode="strict"):
        assert_batch_invariant(batch_fn(model, inputs), tuple(inputs[k] for k in LATENTS), sizes=(2, 3))


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float64))
@pytest.mark.parametrize("mode", ("strict", "audit"))
def test_non_fp32_timestep_is_refused_naming_timestep(dtype, mode):
    # diffusers' LoRA layerwise-casting test casts every float input, the timestep included, to the
    # compute dtype; diffusers upcasts it again, flowlock refuses it (timestep_sinusoid's contract).
    # The refusal used to surface from inside the op as "t must have dtype in (float32)".
    model = tiny_h3()
    inputs = tiny_inputs(1)
    inputs["timestep"] = inputs["timestep"].to(dtype)
    with flowlock.patch(model, mode=mode), pytest.raises(TypeError, match=r"^timestep must be float32, got"):
        model(**inputs)
