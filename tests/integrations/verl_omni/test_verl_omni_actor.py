"""The strict actor of verl-omni's H3 adapters (``integrations.verl_omni.actor``): patched once on
first use and checked by identity on every call, the FlowGRPO replay in verl-omni's output
contract, the DiffusionNFT per-sample layout, and the SDE window the rollout selects."""

import pytest
import torch
from engine_inputs import ENGINE_CONFIG
from verl_rollout import rollout_record, stack

import flowlock
from flowlock.integrations.verl_omni import RequestNoise, actor
from flowlock.integrations.verl_omni.rollout import sde_window
from flowlock.models.minimax_h3 import make_h3

NUM_STEPS, ETA, SELECTED = 3, 0.6, {0, 2}


@pytest.fixture
def model():
    model = make_h3(ENGINE_CONFIG, seed=5)
    yield model
    handle = actor.strict_handle(model)
    if handle is not None and handle.active and not handle.overwritten():
        handle.remove()


@pytest.fixture
def record(model):
    with flowlock.patch(model, mode="strict"):
        return stack([rollout_record(model, RequestNoise(40 + i, i), prompt_seed=3 + i, num_steps=NUM_STEPS,
                                     selected=SELECTED, eta=ETA) for i in range(3)])


def test_the_module_is_patched_once_and_its_replay_has_the_rollouts_bits(model, record):
    outputs = []
    for transition in range(len(SELECTED)):
        step = actor.replay_inputs(model, record[[2, 0]], transition, num_inference_steps=NUM_STEPS)
        with torch.enable_grad():
            outputs.append(actor.replay(model, step, eta=ETA))
        assert torch.equal(outputs[-1].log_prob.detach(), record[[2, 0]]["all_log_probs"][:, transition])
    handle = actor.strict_handle(model)
    assert handle is not None and handle.active
    assert actor.strict_transformer(model) is model and actor.strict_handle(model) is handle


def test_the_replay_outputs_follow_verl_omnis_contract(model, record):
    step = actor.replay_inputs(model, record[[1]], 1, num_inference_steps=NUM_STEPS)
    out = actor.replay(model, step, eta=ETA)
    nv, na = step.next_video[0].numel(), step.next_audio[0].numel()
    assert out.log_prob.shape == (1,) and out.mean.shape == (1, 1, nv + na)
    assert out.std.shape == (1, 1, 1) and out.sqrt_dt.shape == (1,)
    sv, sv1, sa, sa1 = (float(x) for x in (step.sigma_video, step.sigma_video_next, step.sigma_audio,
                                           step.sigma_audio_next))
    std_v, std_a = (s * torch.sin(torch.tensor(ETA * torch.pi / 2, dtype=torch.float64)) for s in (sv1, sa1))
    expected_std = ((nv * std_v**2 + na * std_a**2) / (nv + na)).sqrt()
    expected_dt = ((nv * (sv - sv1) + na * (sa - sa1)) / (nv + na)) ** 0.5
    assert abs(float(out.std) - float(expected_std)) <= 1e-6 * float(expected_std)
    assert abs(float(out.sqrt_dt) - expected_dt) <= 1e-6 * expected_dt
    with pytest.raises(ValueError, match="sde_type='cps'"):
        actor.replay(model, step, eta=ETA, sde_type="sde")


def test_a_forward_replaced_after_the_patch_is_refused_by_name(model, record):
    step = actor.replay_inputs(model, record[[0]], 0, num_inference_steps=NUM_STEPS)
    actor.replay(model, step, eta=ETA)
    stock_block = model.transformer_blocks[1].forward
    model.transformer_blocks[1].__dict__["forward"] = lambda *a, **k: stock_block(*a, **k)
    model.__dict__["forward"] = lambda *a, **k: None
    with pytest.raises(actor.ForwardReplacedError, match=r"<root>\.forward, transformer_blocks\.1\.forward"):
        actor.replay(model, step, eta=ETA)


def test_a_grid_the_rollout_did_not_use_is_refused_before_the_forward(model, record):
    # transition 0 is grid step 0, where every grid has sigma = 1: the record's later transition shows it
    with pytest.raises(ValueError, match=r"record\['all_timesteps'\]\[0, 1\] .* sigma grid differs"):
        actor.replay_inputs(model, record[[0]], 0, num_inference_steps=NUM_STEPS + 1)
    assert actor.strict_handle(model) is None


def test_the_nft_layout_is_the_recorded_one_and_a_short_prompt_is_refused(record):
    kwargs = actor.nft_sample_inputs(record, 1, int(record["prompt_embeds_mask"][1].sum()))
    seq_len = int(record["h3_seq_len"][1])
    assert torch.equal(kwargs["position_ids"], record["h3_position_ids"][1, :seq_len])
    assert torch.equal(kwargs["timestep_indices"], torch.zeros(seq_len, dtype=torch.long))
    with pytest.raises(ValueError, match="do not complete the recorded layout"):
        actor.nft_sample_inputs(record, 1, 1)


def test_the_sde_window_is_verl_omnis_selection():
    assert sde_window(6, window_size=None) == list(range(6))
    runs = {tuple(sde_window(10, window_size=3, window_range=(2, 9), seed=s)) for s in range(40)}
    assert len(runs) > 1
    assert all(r == tuple(range(r[0], r[0] + 3)) and 2 <= r[0] and r[-1] < 9 for r in runs)
    picks = sde_window(10, window_size=4, contiguous=False, seed=7)
    assert picks == sorted(set(picks)) and len(picks) == 4 and picks == sde_window(10, window_size=4,
                                                                                  contiguous=False, seed=7)
    with pytest.raises(ValueError, match="does not fit"):
        sde_window(4, window_size=5)


def test_lora_configs_the_rollout_cannot_match_are_refused():
    assert actor.lora_config_refusals(rank=0, alpha=3, merge=True) == []
    assert actor.lora_config_refusals(rank=16, alpha=32, merge=False) == []
    [scale] = actor.lora_config_refusals(rank=16, alpha=24, merge=False)
    assert "24 / 16 is not a power of two" in scale
    [merge] = actor.lora_config_refusals(rank=8, alpha=8, merge=True)
    assert "lora.merge=True" in merge
