"""A verl-omni H3 request sampled on vLLM-Omni's native DiT by flowlock's strict rollout
(``vllm_request.sample_request``): the diffusers actor replays its FlowGRPO transitions to the same
bits, regenerates its DiffusionNFT clean sample from the noise key alone, and the sampler refuses
what it cannot make exact."""

import dataclasses

import pytest
import torch
from engine_inputs import ENGINE_CONFIG
from tensordict import TensorDict

import flowlock
from flowlock.integrations.verl_omni import RequestNoise, replay_log_prob, replay_step, row_widths
from flowlock.integrations.verl_omni.rollout import cps_rollout
from flowlock.integrations.verl_omni.vllm_request import H3Request, sample_request
from flowlock.integrations.vllm_omni import plugin
from flowlock.models.minimax_h3 import make_h3
from flowlock.rl import h3_schedules

NUM_STEPS, ETA, SELECTED, MAX_TEXT = 4, 0.7, (0, 2), 8


@pytest.fixture(scope="module")
def actor():
    model = make_h3(ENGINE_CONFIG, seed=3)
    with flowlock.patch(model, mode="strict"):
        yield model


def _native(actor, monkeypatch, switch):
    from vllm_omni_env import build_native

    monkeypatch.setenv(plugin.SWITCH_ENV, switch)
    plugin.register()
    return build_native(ENGINE_CONFIG, actor.state_dict())


@pytest.fixture
def native(actor, monkeypatch):
    try:
        yield _native(actor, monkeypatch, "strict")
    finally:
        plugin.unregister()


def _request(seed, text_len=5):
    gen = torch.Generator().manual_seed(seed)
    text = torch.randn(text_len, ENGINE_CONFIG["text_dim"], generator=gen).to(torch.bfloat16)
    return H3Request(text_embeddings=text, text_tags=None, latent_t=2, latent_h=4, latent_w=6, audio_t=4,
                     num_steps=NUM_STEPS)


def _record(native, seeds, selected=SELECTED):
    records = []
    for i, seed in enumerate(seeds):
        result, layout = sample_request(native, _request(seed), RequestNoise(500 + i, i), selected=selected,
                                        eta=ETA, max_text_len=MAX_TEXT)
        records.append({**result.record, **layout})
    return TensorDict({k: torch.cat([r[k] for r in records]) for k in records[0]}, batch_size=[len(records)])


def test_the_actor_replays_the_native_rollouts_transitions_to_their_bits(actor, native):
    record = _record(native, [11, 12, 13])
    sched = h3_schedules(NUM_STEPS, convention="evaluations")
    for rows in ([0], [2, 1], [1, 0, 2]):
        for transition in range(len(SELECTED)):
            step = replay_step(record[rows], transition, sched, row_widths=row_widths(actor))
            with torch.enable_grad():
                result = replay_log_prob(actor, step, eta=ETA)
            assert torch.equal(result.log_prob.detach(), record[rows]["all_log_probs"][:, transition])


def test_the_actor_regenerates_the_nft_clean_sample_from_the_key(actor, native):
    """DiffusionNFT's strict rollout is the deterministic sampler (no selected transition): the actor runs
    the same loop on its own velocities from the recorded key and layout and lands on the same rows."""
    result, layout = sample_request(native, _request(21), RequestNoise(9, 4), selected=(), eta=ETA,
                                    max_text_len=MAX_TEXT)
    assert set(result.record) == {"flowlock_noise_seed", "flowlock_noise_sample_id"}
    key = RequestNoise.from_record(result.record, 0)
    seq_len, nv, na = int(layout["h3_seq_len"]), int(layout["h3_video_rows"]), int(layout["h3_audio_rows"])
    text_len = int(layout["prompt_embeds_mask"].sum())
    kwargs = dict(encoder_hidden_states=layout["prompt_embeds"][:, :text_len],
                  token_tags=layout["h3_token_tags"][0, :seq_len], position_ids=layout["h3_position_ids"][0, :seq_len],
                  video_indices=layout["h3_video_indices"][0], audio_indices=layout["h3_audio_indices"][0],
                  text_indices=layout["h3_text_indices"][0, :text_len])
    audio_rows = torch.zeros(seq_len, dtype=torch.long)
    audio_rows[kwargs["audio_indices"]] = 1

    def velocity(video, audio, t_video, t_audio):
        v, a = actor(hidden_states=video[None], audio_hidden_states=audio[None],
                     timestep=torch.tensor([t_video, t_audio]), timestep_indices=audio_rows, return_dict=False,
                     **kwargs)
        return v[0], a[0]

    replayed = cps_rollout(velocity, key, rows=(nv, na), row_widths=row_widths(actor),
                           schedules=h3_schedules(NUM_STEPS, convention="evaluations"), selected=(), eta=ETA)
    assert torch.equal(replayed.video, result.video) and torch.equal(replayed.audio, result.audio)


def test_a_stock_worker_dit_and_off_grid_shifts_are_refused(actor, monkeypatch):
    try:
        stock = _native(actor, monkeypatch, "off")
        with pytest.raises(RuntimeError, match=f"{plugin.SWITCH_ENV}=strict"):
            sample_request(stock, _request(1), RequestNoise(1, 0), selected=SELECTED, eta=ETA, max_text_len=MAX_TEXT)
    finally:
        plugin.unregister()
    try:
        strict = _native(actor, monkeypatch, "strict")
        with pytest.raises(ValueError, match="video shift"):
            sample_request(strict, dataclasses.replace(_request(1), video_shift=5.0), RequestNoise(1, 0),
                           selected=SELECTED, eta=ETA, max_text_len=MAX_TEXT)
        with pytest.raises(ValueError, match="max_sequence_length"):
            sample_request(strict, _request(1, text_len=9), RequestNoise(1, 0), selected=SELECTED, eta=ETA,
                           max_text_len=MAX_TEXT)
        with pytest.raises(ValueError, match="grid steps"):
            sample_request(strict, _request(1), RequestNoise(1, 0), selected=(NUM_STEPS,), eta=ETA,
                           max_text_len=MAX_TEXT)
    finally:
        plugin.unregister()
