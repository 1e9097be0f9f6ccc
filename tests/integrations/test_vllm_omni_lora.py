"""Strict LoRA across engines: a peft LoRA on the diffusers trainer, synced into vLLM-Omni's own LoRA
layers by ``map_lora_update_to_engine`` (in-memory tensors, as verl-omni syncs), gives the rollout the
trainer's bits: velocities and CPS log-probs, alone, padded and packed. Per-module ranks differ
(rank 4 padded to vLLM's bucket of 8, and rank 8) and the scale 2 is folded into lora_B.
Planted wrong syncs (fc1 lora_B halves unswapped, the scale left unfolded) must be caught."""

import pytest
import torch
from engine_inputs import ENGINE_CONFIG, diffusers_kwargs, make_request, native_kwargs, request_rows
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict
from vllm_omni_env import build_native

import flowlock
from flowlock.integrations.vllm_omni import install
from flowlock.integrations.vllm_omni.lora import add_lora_to_engine, map_lora_update_to_engine
from flowlock.models.common.peft_lora import is_peft_lora
from flowlock.models.minimax_h3 import make_h3
from flowlock.rl import cps_step, joint_log_prob, noise
from flowlock.testing import assert_bitwise_equal

TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"]
# scale 8 / 4 = 16 / 8 = 2 everywhere; ff.net.2 at rank 8 fills vLLM's rank bucket, the rest pad to it
CONFIG = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, rank_pattern={"ff.net.2": 8},
                    alpha_pattern={"ff.net.2": 16})


def _trained_lora(model, seed: int = 3, dtype=torch.bfloat16):
    """Give every LoRA factor random values, as after training (peft starts lora_B at zero)."""
    gen = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if is_peft_lora(module):
            for factor in (module.lora_A["default"], module.lora_B["default"]):
                factor.weight.data = (torch.randn(factor.weight.shape, generator=gen) * 0.2).to(dtype)


@pytest.fixture(scope="module")
def trainer():
    model = make_h3(ENGINE_CONFIG, seed=0)
    base = model.state_dict()
    model.add_adapter(CONFIG)
    _trained_lora(model)
    return model, base, get_peft_model_state_dict(model)


def _rollout(base, tensors, config=CONFIG):
    native = build_native(ENGINE_CONFIG, base)
    mapped, engine_config = map_lora_update_to_engine(tensors, config.to_dict(), model=native)
    manager = add_lora_to_engine(native, mapped, engine_config)
    return native, manager


@pytest.fixture(scope="module")
def engines(trainer):
    model, base, tensors = trainer
    native, manager = _rollout(base, tensors)
    with flowlock.patch(model), install(native):
        yield model, native, manager


def _trainer_rows(model, request):
    with torch.no_grad(), flowlock.mode("strict"):
        out = model(**diffusers_kwargs(request))
    return out.sample[0] * request.branch.update_mask.unsqueeze(-1), out.audio_sample[0]


def _rollout_rows(native, requests, mode="strict"):
    with torch.no_grad(), flowlock.mode(mode) as frame:
        out = native(**native_kwargs(requests))
    if mode == "strict":
        assert frame.fallbacks == []
    return out


def test_every_lora_layer_is_wrapped_by_vllm_omni(engines):
    _, native, manager = engines
    blocks = [*native.blocks, *native.token_refiner.blocks]
    assert len(manager._lora_modules) == 4 * len(blocks)
    for block in blocks:
        for layer in (block.attn.qkv_proj, block.attn.out_proj, block.mlp.fc1, block.mlp.fc2):
            assert all(layer._diffusion_lora_active_slices), layer
    # rank 4 sits zero-padded in vLLM's bucket of 8: the strict path must read the adapter's own rank
    assert native.blocks[0].attn.qkv_proj.lora_a_stacked[0].shape[2] == 8


@pytest.mark.parametrize("case", [dict(seed=1, seq_len=25), dict(seed=1), dict(seed=3, keyframe=True)],
                         ids=["unpadded", "padded", "keyframe"])
def test_rollout_gives_the_trainer_bits(engines, case):
    model, native, _ = engines
    request = make_request(**case)
    assert_bitwise_equal(_rollout_rows(native, [request]), _trainer_rows(model, request), "LoRA rollout vs trainer")


def test_packed_rollout_gives_each_request_the_trainer_bits(engines):
    model, native, _ = engines
    requests = [make_request(seed=5), make_request(seed=6, text_len=7, latent_t=1, audio_t=3, t_video=0.7),
                make_request(seed=7, keyframe=True, seq_len=41)]
    video, audio = _rollout_rows(native, requests)
    for i, request in enumerate(requests):
        assert_bitwise_equal(request_rows(requests, i, video, audio), _trainer_rows(model, request), f"request {i}")


def test_cps_log_probs_equal_through_flowlock_rl(engines):
    model, native, _ = engines
    requests = [make_request(seed=12), make_request(seed=13, text_len=6, audio_t=5, t_video=0.6, t_audio=0.4)]
    video, audio = _rollout_rows(native, requests)
    for i, request in enumerate(requests):
        rows = (request.video, request.audio)
        sigmas = (1.0 - request.t_video, 1.0 - request.t_audio)
        results = []
        for velocities, prev in ((request_rows(requests, i, video, audio), None), (_trainer_rows(model, request),
                                                                                   "rollout")):
            steps = []
            for k, (modality, x, v, sigma) in enumerate(zip(("video", "audio"), rows, velocities, sigmas)):
                target = {"noise": noise(11, i, 0, modality, (1, *x.shape))} if prev is None else {
                    "prev_sample": results[0][k].next_sample}
                steps.append(cps_step(x[None], v[None], torch.tensor([sigma]), torch.tensor([sigma - 0.1]), eta=0.8,
                                      **target))
            results.append(steps)
        logps = [[s.log_prob for s in steps] + [joint_log_prob(steps[0].log_prob, steps[1].log_prob,
                                                               request.video.numel(), request.audio.numel(),
                                                               flavour="verl")] for steps in results]
        assert_bitwise_equal(logps[0], logps[1], f"request {i} CPS log-probs")


def _request(adapter_id):
    from vllm_omni.lora.request import LoRARequest

    return LoRARequest(lora_name=f"flowlock-sync-{adapter_id}", lora_int_id=adapter_id,
                       lora_path=f"/flowlock/in-memory/{adapter_id}")


def test_suspended_adapter_gives_the_base_bits(engines):
    model, native, manager = engines
    request = make_request(seed=2, seq_len=25)
    manager.set_active_adapter(None)
    model.disable_adapters()
    try:
        assert_bitwise_equal(_rollout_rows(native, [request]), _trainer_rows(model, request), "suspended LoRA")
    finally:
        model.enable_adapters()
        manager.set_active_adapter(_request(1), 1.0)
    assert all(native.blocks[0].mlp.fc1._diffusion_lora_active_slices)


def _unswap_fc1(tensors):
    # the planted mistake: the trainer's fc1 lora_B halves sent in diffusers' [value; gate] order
    out = dict(tensors)
    for name, tensor in tensors.items():
        if ".mlp.fc1_0.lora_B" in name:
            other = name.replace("fc1_0", "fc1_1")
            out[name], out[other] = tensors[other], tensor
    return out


def _unfold(tensors):
    # the planted mistake: the scale 2 never reaches lora_B
    return {name: (t / 2 if ".lora_B." in name else t) for name, t in tensors.items()}


@pytest.mark.parametrize("plant", [_unswap_fc1, _unfold], ids=["fc1_halves_unswapped", "scale_unfolded"])
def test_harness_catches_a_wrong_sync(trainer, engines, plant):
    _, base, tensors = trainer
    model = engines[0]  # patched already
    native = build_native(ENGINE_CONFIG, base)
    mapped, engine_config = map_lora_update_to_engine(tensors, CONFIG.to_dict(), model=native)
    add_lora_to_engine(native, plant(mapped), engine_config)
    request = make_request(seed=1, seq_len=25)
    with install(native):
        rollout, expected = _rollout_rows(native, [request]), _trainer_rows(model, request)
    with pytest.raises(AssertionError, match="not bitwise equal"):
        assert_bitwise_equal(rollout, expected)


def test_a_lora_layer_strict_cannot_compute_is_named_before_any_op(trainer):
    from vllm.config import LoRAConfig, set_current_vllm_config
    from vllm_omni.diffusion.lora.layers import DiffusionMergedQKVParallelLinearWithLoRA
    from vllm_omni_env import vllm_config

    native = build_native(ENGINE_CONFIG, trainer[1])
    attn = native.blocks[1].attn
    with set_current_vllm_config(vllm_config()):
        wrapper = DiffusionMergedQKVParallelLinearWithLoRA(attn.qkv_proj)
        wrapper.create_lora_weights(2, LoRAConfig(max_lora_rank=8, max_loras=2, lora_dtype=torch.bfloat16))
    attn.qkv_proj = wrapper
    with install(native), flowlock.mode("strict") as frame:
        with pytest.raises(flowlock.StrictModeError, match="blocks.1.attn.qkv_proj: more than one LoRA slot"):
            native(**native_kwargs([make_request(seed=1)]))
    assert frame.ran == []
