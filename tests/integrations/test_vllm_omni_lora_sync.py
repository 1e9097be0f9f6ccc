"""``map_lora_update_to_engine``: the layout it produces, and every sync it refuses before mapping
anything (a tensor that wraps no layer, a broken pair, a scale whose folding cannot give the
trainer's bits)."""

import re

import pytest
import torch
from engine_inputs import ENGINE_CONFIG
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict
from vllm_omni_env import build_native

import flowlock
from flowlock.integrations.vllm_omni.lora import FC1_LAYOUT, install_lora_layout, map_lora_update_to_engine
from flowlock.models.common.peft_lora import is_peft_lora
from flowlock.models.minimax_h3 import make_h3

TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"]
FFN = ENGINE_CONFIG["ffn_dim"]


@pytest.fixture(scope="module")
def native():
    return build_native(ENGINE_CONFIG, make_h3(ENGINE_CONFIG, seed=0).state_dict())


@pytest.fixture(scope="module")
def lora():
    model = make_h3(ENGINE_CONFIG, seed=0)
    model.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    gen = torch.Generator().manual_seed(1)
    for module in model.modules():
        if is_peft_lora(module):
            for factor in (module.lora_A["default"], module.lora_B["default"]):
                factor.weight.data = torch.randn(factor.weight.shape, generator=gen).to(torch.bfloat16)
    return get_peft_model_state_dict(model)


def _config(**overrides):
    return {"r": 4, "lora_alpha": 8, "target_modules": TARGETS, **overrides}


def test_engine_layout(native, lora):
    mapped, config = map_lora_update_to_engine(lora, _config(), model=native)
    assert config == {"r": 4, "lora_alpha": 4, "target_modules": ["fc1_0", "fc1_1", "fc2", "out_proj", "to_k", "to_q",
                                                                  "to_v"], "use_rslora": False, "use_dora": False}
    src, dst = "transformer_blocks.1.", "transformer.blocks.1."
    plain = (("attn.to_q", "attn.to_q"), ("attn.to_out.0", "attn.out_proj"), ("ff.net.2", "mlp.fc2"))
    for target, native_name in plain:
        assert torch.equal(mapped[f"{dst}{native_name}.lora_A.weight"], lora[f"{src}{target}.lora_A.weight"])
        assert torch.equal(mapped[f"{dst}{native_name}.lora_B.weight"], lora[f"{src}{target}.lora_B.weight"] * 2)
    a, b = lora[f"{src}ff.net.0.proj.lora_A.weight"], lora[f"{src}ff.net.0.proj.lora_B.weight"] * 2
    for sub, half in (("fc1_0", b[FFN:]), ("fc1_1", b[:FFN])):  # native gate = diffusers' second half
        assert torch.equal(mapped[f"{dst}mlp.{sub}.lora_A.weight"], a)
        assert torch.equal(mapped[f"{dst}mlp.{sub}.lora_B.weight"], half)
    assert "transformer.token_refiner.blocks.0.attn.to_v.lora_B.weight" in mapped
    assert len(mapped) == 2 * 7 * (ENGINE_CONFIG["num_layers"] + ENGINE_CONFIG["num_refiner_layers"])


def test_install_lora_layout_keeps_qkv_and_is_idempotent(native):
    qkv = tuple(native.stacked_params_mapping)
    install_lora_layout(native)
    install_lora_layout(native)
    assert native.stacked_params_mapping == qkv + FC1_LAYOUT


@pytest.mark.parametrize("name", ["proj_out.lora_A.weight", "transformer_blocks.7.attn.to_q.lora_A.weight",
                                  "transformer_blocks.0.attn.to_qq.lora_A.weight",
                                  "transformer_blocks.0.attn.to_q.weight",
                                  "transformer_blocks.0.adaln_proj.linear.lora_A.weight"])
def test_a_tensor_that_wraps_no_layer_is_named(native, lora, name):
    tensors = {**lora, name: torch.zeros(4, ENGINE_CONFIG["hidden_size"], dtype=torch.bfloat16)}
    with pytest.raises(ValueError, match=f"{name.replace('.', '[.]')}.*wraps no layer"):
        map_lora_update_to_engine(tensors, _config(), model=native)


def test_broken_pairs_are_named(native, lora):
    key = "transformer_blocks.0.attn.to_k.lora_B.weight"
    missing = {k: v for k, v in lora.items() if k != key}
    with pytest.raises(ValueError, match="transformer_blocks.0.attn.to_k is incomplete: lora_B is missing"):
        map_lora_update_to_engine(missing, _config(), model=native)
    wrong = {**lora, key: lora[key][:-1]}
    with pytest.raises(ValueError, match="transformer_blocks.0.attn.to_k: lora_A .* do not fit"):
        map_lora_update_to_engine(wrong, _config(), model=native)
    with pytest.raises(ValueError, match="DoRA"):
        map_lora_update_to_engine(lora, _config(use_dora=True), model=native)


def _refused(native, tensors, config, reason, module=r"\S+"):
    with pytest.raises(flowlock.StrictModeError, match=f"lora sync {module}: {re.escape(reason)}"):
        map_lora_update_to_engine(tensors, config, model=native)
    with flowlock.mode("audit") as frame:
        map_lora_update_to_engine(tensors, config, model=native)
    assert frame.fallbacks and all(reason.split(" ")[0] in f.reason for f in frame.fallbacks)


def test_a_scale_that_is_not_a_power_of_two_is_refused_in_strict(native, lora):
    _refused(native, lora, _config(lora_alpha=6), "scale alpha / r = 6 / 4 = 1.5 is not a power of two")
    # rsLoRA: 8 / sqrt(4) = 4 folds exactly
    map_lora_update_to_engine(lora, _config(use_rslora=True), model=native)


def test_folding_that_overflows_is_refused_in_strict(native, lora):
    key = "transformer_blocks.0.ff.net.2.lora_B.weight"
    huge = {**lora, key: lora[key].clone().fill_(torch.finfo(torch.bfloat16).max)}
    _refused(native, huge, _config(), "lora_B * 2 overflows", module="transformer_blocks.0.ff.net.2")


def test_factors_in_another_dtype_than_the_base_layer_are_refused_in_strict(native, lora):
    _refused(native, {k: v.float() for k, v in lora.items()}, _config(), "factors are torch.float32")


def test_a_zero_last_row_of_lora_a_is_refused_in_strict(native, lora):
    key = "transformer_blocks.0.attn.to_q.lora_A.weight"
    zero = lora[key].clone()
    zero[-1] = 0
    _refused(native, {**lora, key: zero}, _config(), "the last row of lora_A is all zero",
             module="transformer_blocks.0.attn.to_q")
