"""Strict LoRA on the tiny H3 wrapped by peft: accuracy against a merged-weight FP64 golden,
batch invariance, and refusal of what strict cannot compute (active dropout, DoRA)."""

import pytest
import torch
from h3_helpers import batch_fn, forward_backward, pool
from peft import LoraConfig

import flowlock
from flowlock.models.common.peft_lora import is_peft_lora
from flowlock.models.minimax_h3 import tiny_h3, tiny_inputs
from flowlock.models.minimax_h3.golden import golden_inputs, golden_model
from flowlock.testing import assert_batch_invariant, assert_within_budget

TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ff.net.2", "proj_out"]


def _lora_h3(adapter_dtype=torch.bfloat16, **config):
    model = tiny_h3()
    config.setdefault("init_lora_weights", "gaussian")  # every factor is redrawn below anyway
    model.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, **config))
    gen = torch.Generator().manual_seed(11)
    for module in model.modules():
        if is_peft_lora(module):
            for factor in (module.lora_A["default"], module.lora_B["default"]):
                for p in (factor.weight, factor.bias):
                    if p is not None:
                        p.data = (torch.randn(p.shape, generator=gen) * 0.1).to(adapter_dtype)
    return model


@pytest.mark.parametrize("adapter_dtype", [torch.bfloat16, torch.float32])
def test_strict_lora_within_budget_of_merged_golden(adapter_dtype):
    model, inputs = _lora_h3(adapter_dtype), tiny_inputs(2, seed=7)
    unmerged = golden_model(model)
    merged = golden_model(model)
    for module in merged.modules():
        if is_peft_lora(module):
            module.merge()  # in float64: W + scaling * B @ A without rounding
    merged_out, merged_grads = forward_backward(merged, golden_inputs(inputs), input_grad=True)
    _, lora_golden_grads = forward_backward(unmerged, golden_inputs(inputs))
    eager_out, eager_grads = forward_backward(model, inputs, input_grad=True)
    with flowlock.patch(model), flowlock.mode("strict") as frame:
        strict_out, strict_grads = forward_backward(model, inputs, input_grad=True)
    assert frame.fallbacks == []
    for name, actual, gold, eager in zip(("sample", "audio_sample"), strict_out, merged_out, eager_out):
        assert_within_budget(actual, gold, baseline=eager, what=name)
    name = "input:hidden_states"
    assert_within_budget(strict_grads[name], merged_grads[name], baseline=eager_grads[name], what=name)
    # add_adapter freezes the base weights: the trainable gradients are the LoRA factors'.
    assert len(lora_golden_grads) == 2 * sum(is_peft_lora(m) for m in model.modules()) > 0
    for name, gold in lora_golden_grads.items():
        assert_within_budget(strict_grads[name], gold, baseline=eager_grads[name], what=f"grad {name}")


def test_strict_lora_batch_invariant():
    model = _lora_h3()
    inputs, latents = pool(3, seed=8)
    with flowlock.patch(model):
        assert_batch_invariant(batch_fn(model, inputs), latents, sizes=(2, 3))


def test_active_lora_dropout_raises_in_strict_and_falls_back_in_audit():
    model, inputs = _lora_h3(lora_dropout=0.1), tiny_inputs(1)
    model.train()
    with flowlock.patch(model):
        with pytest.raises(flowlock.StrictModeError, match="dropout"):
            model(**inputs)
        with flowlock.mode("audit") as frame:
            model(**inputs)
    assert frame.fallbacks and all("dropout" in f.reason for f in frame.fallbacks)
    model.eval()
    with flowlock.patch(model), flowlock.mode("strict") as frame, torch.no_grad():
        model(**inputs)
    assert frame.fallbacks == []


def test_dora_is_not_served_in_strict():
    model, inputs = _lora_h3(use_dora=True), tiny_inputs(1)
    with flowlock.patch(model), pytest.raises(flowlock.StrictModeError, match="variant"):
        model(**inputs)


def test_lora_bias_on_b_within_budget_of_the_fp64_golden():
    # peft cannot merge a B bias into a base layer without bias, so the golden is the unmerged fp64 model.
    model, inputs = _lora_h3(lora_bias=True, init_lora_weights=False), tiny_inputs(2, seed=9)
    assert model.transformer_blocks[0].attn.to_q.lora_B["default"].bias is not None
    golden_out, golden_grads = forward_backward(golden_model(model), golden_inputs(inputs))
    eager_out, eager_grads = forward_backward(model, inputs)
    with flowlock.patch(model), flowlock.mode("strict") as frame:
        strict_out, strict_grads = forward_backward(model, inputs)
    assert frame.fallbacks == []
    for name, actual, gold, eager in zip(("sample", "audio_sample"), strict_out, golden_out, eager_out):
        assert_within_budget(actual, gold, baseline=eager, what=name)
    assert any(name.endswith("lora_B.default.bias") for name in golden_grads)
    for name, gold in golden_grads.items():
        assert_within_budget(strict_grads[name], gold, baseline=eager_grads[name], what=f"grad {name}")
