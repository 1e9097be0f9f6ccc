"""verl-omni's H3 FlowGRPO rollout record -> flowlock's strict replay: the actor's log-probs have the
rollout's bits, in any micro-batch composition; every malformed field is refused by name."""

import pytest
import torch
from engine_inputs import ENGINE_CONFIG
from verl_rollout import rollout_record, stack

import flowlock
from flowlock.integrations.verl_omni import RequestNoise, replay_log_prob, replay_step, row_widths
from flowlock.integrations.vllm_omni import plugin
from flowlock.models.minimax_h3 import make_h3
from flowlock.rl import h3_schedules

NUM_STEPS, ETA, SELECTED = 3, 0.8, {0, 2}


@pytest.fixture(scope="module")
def strict_model():
    model = make_h3(ENGINE_CONFIG, seed=0)
    with flowlock.patch(model, mode="strict"):
        yield model


@pytest.fixture(scope="module")
def record(strict_model):
    """Four requests (one prompt layout, different prompts and noise keys), each sampled alone."""
    keys = [RequestNoise(seed=1000 + i, sample_id=i) for i in range(4)]
    with flowlock.mode("strict"):
        return stack([rollout_record(strict_model, key, prompt_seed=7 + i, num_steps=NUM_STEPS, selected=SELECTED,
                                     eta=ETA) for i, key in enumerate(keys)])


def _replay(model, micro_batch, transition, eta=ETA):
    sched = h3_schedules(NUM_STEPS, convention="evaluations")
    step = replay_step(micro_batch, transition, sched, row_widths=row_widths(model))
    with flowlock.mode("strict"), torch.enable_grad():
        return replay_log_prob(model, step, eta=eta)


@pytest.mark.parametrize("rows", [[0], [3, 1], [2, 0, 3, 1]])
def test_replayed_log_probs_have_the_rollouts_bits(strict_model, record, rows):
    micro_batch = record[rows]
    for transition in range(len(SELECTED)):
        result = _replay(strict_model, micro_batch, transition)
        assert torch.equal(result.log_prob.detach(), micro_batch["all_log_probs"][:, transition])
        assert result.log_prob.requires_grad


@pytest.mark.parametrize("switch", ["strict", "off"])
def test_a_vllm_omni_rollout_replays_to_its_bits_in_the_diffusers_actor(strict_model, monkeypatch, switch):
    """The whole path: a rollout worker's native H3, put on the strict path by the vLLM plugin at load,
    verl-omni's record, the diffusers actor's strict replay. Switched off, the worker's stock forward
    computes the rollout and the same comparison sees the drift."""
    from vllm_omni_env import build_native

    monkeypatch.setenv(plugin.SWITCH_ENV, switch)
    plugin.register()
    try:
        native = build_native(ENGINE_CONFIG, strict_model.state_dict())
        assert plugin.installed(native) == (switch == "strict")
        with flowlock.mode("strict"):
            record = stack([rollout_record(strict_model, RequestNoise(77, i), prompt_seed=20 + i, num_steps=NUM_STEPS,
                                           selected=SELECTED, eta=ETA, native=native) for i in range(2)])
    finally:
        plugin.unregister()
    equal = []
    for rows in ([1], [1, 0]):
        for transition in range(len(SELECTED)):
            result = _replay(strict_model, record[rows], transition)
            equal.append(torch.equal(result.log_prob.detach(), record[rows]["all_log_probs"][:, transition]))
    assert all(equal) if switch == "strict" else not any(equal)


def test_the_comparison_sees_a_different_noise_level(strict_model, record):
    result = _replay(strict_model, record[[0]], 0, eta=0.7)
    assert not torch.equal(result.log_prob.detach(), record[[0]]["all_log_probs"][:, 0])


def test_the_mapped_inputs_are_the_requests_layout(strict_model, record):
    sched = h3_schedules(NUM_STEPS, convention="evaluations")
    step = replay_step(record[[1, 2]], 1, sched, row_widths=row_widths(strict_model))
    kwargs = step.model_kwargs
    assert step.grid_step == 2
    assert kwargs["hidden_states"].shape == (2, 12, 96) and kwargs["audio_hidden_states"].shape == (2, 8, 32)
    assert kwargs["encoder_hidden_states"].shape == (2, 5, ENGINE_CONFIG["text_dim"])
    assert torch.equal(kwargs["timestep"], torch.sort(torch.stack([sched.video_timesteps[2],
                                                                   sched.audio_timesteps[2]])).values)
    assert torch.equal(kwargs["timestep"][kwargs["timestep_indices"][kwargs["audio_indices"]]],
                       sched.audio_timesteps[2].expand(8))
    assert torch.equal(step.sigma_video, sched.video_sigmas[2].expand(2))
    assert torch.equal(step.sigma_audio_next, sched.audio_sigmas[3].expand(2))


def _with(record, **changes):
    out = record.clone()
    for key, value in changes.items():
        out[key] = value
    return out


def _refusals(record):
    lat = record["all_next_latents"]
    t = record["all_timesteps"].clone()
    t[:, 1] = torch.nextafter(t[:, 1], torch.ones_like(t[:, 1]))
    meta = record["latent_meta"].clone()
    meta[:, 1] += 1
    mask = record["h3_video_update_mask"].clone()
    mask[:, 0] = False
    rows = record["h3_video_rows"].clone()
    rows[1] += 1
    text_mask = record["prompt_embeds_mask"].clone()
    text_mask[:, 0] = 0
    steps = record["h3_step_indices"].clone()
    steps[:, 1] = NUM_STEPS
    tags = record["h3_token_tags"].clone()
    tags[:, record["h3_audio_indices"][0, 0]] = 0
    return [
        (KeyError, "'all_next_latents'", record.exclude("all_next_latents")),
        (KeyError, "'h3_step_indices'", record.exclude("h3_step_indices")),
        (TypeError, "'all_next_latents'.*float32", _with(record, all_next_latents=lat.double())),
        (ValueError, "'all_next_latents'.*shape", _with(record, all_next_latents=lat[..., :-1])),
        (TypeError, "'h3_audio_timesteps'", _with(record, h3_audio_timesteps=record["h3_audio_timesteps"].half())),
        (ValueError, "'all_timesteps'.*sigma grid", _with(record, all_timesteps=t)),
        (ValueError, "'h3_step_indices'.*grid step 3", _with(record, h3_step_indices=steps)),
        (ValueError, "'latent_meta'", _with(record, latent_meta=meta)),
        (ValueError, "'h3_video_update_mask'.*condition rows", _with(record, h3_video_update_mask=mask)),
        (ValueError, "'h3_video_rows'.*differs", _with(record, h3_video_rows=rows)),
        (ValueError, "'prompt_embeds_mask'", _with(record, prompt_embeds_mask=text_mask)),
        (ValueError, "'h3_token_tags'", _with(record, h3_token_tags=tags)),
    ]


def test_every_malformed_field_is_refused_by_name(strict_model, record):
    sched = h3_schedules(NUM_STEPS, convention="evaluations")
    widths = row_widths(strict_model)
    for error, match, bad in _refusals(record):
        before = {k: v.clone() for k, v in bad.items()}
        # transition 1 reads grid step h3_step_indices[:, 1]; every other refusal holds for both
        with pytest.raises(error, match=match):
            replay_step(bad, 1, sched, row_widths=widths)
        assert all(torch.equal(v, bad[k]) for k, v in before.items()), "the record was written"
    with pytest.raises(ValueError, match="transition must be"):
        replay_step(record, 2, sched, row_widths=widths)
    with pytest.raises(ValueError, match="sigma grid"):
        replay_step(record, 1, h3_schedules(NUM_STEPS + 1, convention="evaluations"), row_widths=widths)
    with pytest.raises(TypeError, match="schedules"):
        replay_step(record, 0, sched.video_sigmas, row_widths=widths)
    with pytest.raises(ValueError, match="row_widths"):
        replay_step(record, 0, sched, row_widths=(96, 0))
    with pytest.raises(KeyError, match="'h3_seq_len', 'prompt_embeds'"):
        replay_step(record.exclude("prompt_embeds", "h3_seq_len"), 0, sched, row_widths=widths)
