"""What the strict vLLM-Omni path refuses: strict mode raises StrictModeError naming the module before
any op runs, audit mode records the fallback and runs that module's own forward; bad inputs are a
clear error before any op."""

from types import SimpleNamespace

import pytest
import torch
from engine_inputs import make_request, native_kwargs
from torch import nn
from vllm.config import LoRAConfig, set_current_vllm_config
from vllm.model_executor.layers.linear import LinearMethodBase
from vllm_omni.diffusion.hooks.base import HookRegistry, ModelHook
from vllm_omni.diffusion.lora.layers import DiffusionQKVParallelLinearWithLoRA
from vllm_omni_env import vllm_config

import flowlock
from flowlock.integrations.vllm_omni import install
from flowlock.testing import assert_bitwise_equal


class _FakeQuant(LinearMethodBase):
    def create_weights(self, *args, **kwargs):
        raise NotImplementedError

    def apply(self, layer, x, bias=None):
        return nn.functional.linear(x, layer.weight, bias)


class _SageBackend:
    @staticmethod
    def get_name():
        return "SAGE_ATTN"


def _lora(model):
    attn = model.blocks[0].attn
    with set_current_vllm_config(vllm_config()):
        wrapper = DiffusionQKVParallelLinearWithLoRA(attn.qkv_proj)
        wrapper.create_lora_weights(1, LoRAConfig(max_lora_rank=8, max_loras=1, lora_dtype=torch.bfloat16))
    attn.qkv_proj = wrapper


def _quantized(model):
    model.blocks[0].attn.qkv_proj.quant_method = _FakeQuant()


def _biased(model):
    fc2 = model.blocks[1].mlp.fc2
    fc2.bias = nn.Parameter(torch.zeros(fc2.weight.shape[0], dtype=fc2.weight.dtype))


def _sage(model):
    model.blocks[1].attn.attention.attn_backend = _SageBackend


def _tensor_parallel(model):
    model.condition_proj.tp_size = 2


def _cache_dit(model):
    model._is_cached = True


def _ulysses(model):
    model.parallel_config = SimpleNamespace(ulysses_degree=2)


def _hook(model):
    HookRegistry.get_or_create(model.blocks[0]).register_hook("teacache", ModelHook())


DEFECTS = {
    "quantized": (_quantized, "blocks.0.attn.qkv_proj", "quantized"),
    "lora": (_lora, "blocks.0.attn.qkv_proj", "DiffusionQKVParallelLinearWithLoRA: vLLM-Omni LoRA layers"),
    "biased": (_biased, "blocks.1.mlp.fc2", "a bias where H3 has none"),
    "backend": (_sage, "blocks.1.attn", "SAGE_ATTN"),
    "tp": (_tensor_parallel, "condition_proj", "tensor parallel size 2"),
    "cache_dit": (_cache_dit, "<root>", "Cache-DiT"),
    "ulysses": (_ulysses, "<root>", "ulysses_degree 2"),
    "hook": (_hook, "<root>", r"hooks \['teacache'\].*blocks.0"),
}


@pytest.mark.parametrize("defect", sorted(DEFECTS))
def test_strict_names_the_module_before_any_op(fresh_native, defect):
    damage, module, reason = DEFECTS[defect]
    damage(fresh_native)
    kwargs = native_kwargs([make_request(seed=1)])
    with install(fresh_native), flowlock.mode("strict") as frame:
        with pytest.raises(flowlock.StrictModeError, match=f"minimax_h3 {module}: .*{reason}"):
            fresh_native(**kwargs)
    assert frame.ran == []


@pytest.mark.parametrize("defect", ["biased", "backend", "cache_dit"])
def test_audit_records_the_fallback_and_runs_the_module_itself(fresh_native, defect):
    damage, module, reason = DEFECTS[defect]
    damage(fresh_native)
    if defect == "backend":
        # the module's own forward needs a backend that runs: restore it, keep the refusal in coverage
        fresh_native.blocks[1].attn.attention.attn_backend = fresh_native.blocks[0].attn.attention.attn_backend
        fresh_native.blocks[1].attn.vsa_sparsity = 0.5
        reason = "VSA"
    kwargs = native_kwargs([make_request(seed=1)])
    with install(fresh_native, mode="audit") as handle, torch.no_grad():
        video, audio = fresh_native(**kwargs)
        if defect == "cache_dit":
            # a model-level refusal runs vLLM-Omni's whole forward: its own bits
            with flowlock.mode("provider"):
                assert_bitwise_equal((video, audio), fresh_native(**kwargs), "audit fallback vs stock")
    assert [f.op for f in handle.fallbacks] == [f"vllm_omni minimax_h3 {module}"]
    assert reason in handle.fallbacks[0].reason
    assert video.isfinite().all() and audio.isfinite().all()


def _bad(name, value):
    def change(kwargs):
        kwargs[name] = value(kwargs) if callable(value) else value
    return change


BAD_INPUTS = {
    "unknown kwarg": (TypeError, "unexpected kwargs", _bad("cfg_scale", 1.0)),
    "missing x": (ValueError, "requires kwarg 'x'", _bad("x", None)),
    "bf16 timesteps": (TypeError, "unique_timesteps",
                       _bad("unique_timesteps", lambda k: k["unique_timesteps"].bfloat16())),
    "timestep 1000 scale": (ValueError, r"unique_timesteps values must lie in \[0.0, 1.0\]",
                            _bad("unique_timesteps", lambda k: k["unique_timesteps"] * 1000)),
    "tag 3": (ValueError, "token_tags values", _bad("token_tags", lambda k: k["token_tags"].clone().fill_(3))),
    "shared rows": (ValueError, "unique and disjoint",
                    _bad("audio_pos_info", lambda k: {"position_ids": k["img_pos_info"]["position_ids"][:3]})),
    "prompt rows": (ValueError, "prompt_embeds has", _bad("prompt_embeds", lambda k: k["prompt_embeds"][:-1])),
    "cu_seqlens": (ValueError, "cu_seqlens_q must rise", _bad("packed_seq_params", lambda k: {
        **k["packed_seq_params"], "cu_seqlens_q": torch.tensor([0, 30, 20, 64], dtype=torch.int32)})),
    "max_seqlen": (ValueError, "one request must have", _bad("packed_seq_params", lambda k: {
        **k["packed_seq_params"], "max_seqlen_q": 10})),
    "update_mask": (ValueError, "update_mask length", _bad("update_mask", lambda k: k["update_mask"][:-1])),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_inputs_raise_before_any_op(engines, case):
    _, native = engines
    error, pattern, change = BAD_INPUTS[case]
    kwargs = native_kwargs([make_request(seed=1)])
    change(kwargs)
    with flowlock.mode("strict") as frame, pytest.raises(error, match=pattern):
        native(**kwargs)
    assert frame.ran == []
