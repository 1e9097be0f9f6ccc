"""Engine invariance: vLLM-Omni + flowlock and diffusers + flowlock give the same bits.

The same weights (vLLM-Omni's ``load_weights`` from the diffusers state dict), the same request
(vLLM-Omni's own packer; the trainer replays the rollout's row order) and BF16 with H3's FP32
modules: video and audio velocities, and the CPS log-probs of ``flowlock.rl`` computed from them,
are bitwise equal across engines, for a request alone or packed with others, padded or not.
"""

import pytest
import torch
from engine_inputs import diffusers_kwargs, make_request, native_kwargs, request_rows

import flowlock
import flowlock.integrations.vllm_omni.forward as native_forward
from flowlock.integrations.vllm_omni.replay import diffusers_requests
from flowlock.rl import cps_step, joint_log_prob, noise
from flowlock.testing import assert_bitwise_equal, assert_repeatable

REQUESTS = {
    "unpadded": dict(seed=1, seq_len=25),
    "padded": dict(seed=1),
    "keyframe": dict(seed=3, keyframe=True),
}


def _diffusers(model, request):
    with torch.no_grad():
        out = model(**diffusers_kwargs(request))
    # vLLM-Omni returns condition rows zeroed; the trainer masks them itself.
    return out.sample[0] * request.branch.update_mask.unsqueeze(-1), out.audio_sample[0]


def _native(model, requests):
    with torch.no_grad():
        return model(**native_kwargs(requests))


@pytest.mark.parametrize("case", sorted(REQUESTS))
def test_one_request_bitwise_equal_across_engines(engines, case):
    diffusers, native = engines
    request = make_request(**REQUESTS[case])
    with flowlock.mode("strict") as rollout_frame:
        rollout = _native(native, [request])
    with flowlock.mode("strict") as trainer_frame:
        trainer = _diffusers(diffusers, request)
    assert_bitwise_equal(rollout, trainer, f"{case}: vLLM-Omni vs diffusers")
    # the same flowlock ops on both sides (the native side adds the input row gathers)
    assert set(rollout_frame.ran) == set(trainer_frame.ran)
    assert {"attention", "qk_norm_rope", "adaln_table", "rms_norm_modulate", "swiglu", "final_adaln_out"} <= {
        op for op, _ in rollout_frame.ran}


def test_padding_rows_never_change_real_rows(engines):
    _, native = engines
    unpadded, padded = make_request(seed=4, seq_len=25), make_request(seed=4)
    assert padded.branch.seq_len == 64 > padded.branch.used_len == 25
    assert_bitwise_equal(_native(native, [padded]), _native(native, [unpadded]), "padded vs unpadded")


def test_packed_requests_bitwise_equal_to_each_alone_in_both_engines(engines):
    diffusers, native = engines
    requests = [make_request(seed=5), make_request(seed=6, text_len=7, latent_t=1, audio_t=3, t_video=0.7, t_audio=0.2),
                make_request(seed=7, keyframe=True, seq_len=41)]
    video, audio = _native(native, requests)
    for i, request in enumerate(requests):
        rows = request_rows(requests, i, video, audio)
        assert_bitwise_equal(rows, _native(native, [request]), f"request {i}: packed vs alone")
        assert_bitwise_equal(rows, _diffusers(diffusers, request), f"request {i}: packed vs diffusers")


def test_replay_splits_a_packed_forward_into_each_request_alone(engines):
    diffusers, native = engines
    requests = [make_request(seed=15, keyframe=True), make_request(seed=16, seq_len=30, text_len=4)]
    packed = native_kwargs(requests)
    video, audio = _native(native, requests)
    replays = diffusers_requests(packed)
    assert len(replays) == len(requests)
    for i, (request, replay) in enumerate(zip(requests, replays)):
        expected = diffusers_kwargs(request)
        assert replay.kwargs.keys() == expected.keys()
        for name, value in expected.items():
            assert torch.equal(replay.kwargs[name], value), f"request {i} {name}"
        assert torch.equal(replay.update_mask, request.branch.update_mask)
        rows = video[replay.video_rows], audio[replay.audio_rows]
        assert_bitwise_equal(rows, request_rows(requests, i, video, audio), f"request {i} output rows")
        with torch.no_grad():
            out = diffusers(**replay.kwargs)
        assert_bitwise_equal(rows, (out.sample[0] * replay.update_mask.unsqueeze(-1), out.audio_sample[0]),
                             f"request {i}: replayed in diffusers")


def test_prepared_rope_table_gives_the_same_bits(engines):
    _, native = engines
    request = make_request(seed=8)
    reference = _native(native, [request])
    request.branch.prepare_rope_table(native)
    assert "rope_table" in request.branch.static_kwargs
    assert_bitwise_equal(_native(native, [request]), reference, "vLLM-Omni's prepared rope_table")


def test_packed_forward_bitwise_repeatable(engines):
    _, native = engines
    requests = [make_request(seed=9), make_request(seed=10, text_len=3)]
    assert_repeatable(lambda: _native(native, requests), runs=3)


def _cps(velocity, sample, sigma, sigma_next, sample_id, modality, prev=None):
    rows = sample[None]
    kwargs = {"prev_sample": prev} if prev is not None else {
        "noise": noise(11, sample_id, 0, modality, tuple(rows.shape))}
    return cps_step(rows, velocity[None], torch.tensor([sigma]), torch.tensor([sigma_next]), eta=0.8, **kwargs)


def test_cps_log_probs_of_a_packed_rollout_equal_the_diffusers_replay(engines):
    diffusers, native = engines
    requests = [make_request(seed=12), make_request(seed=13, text_len=6, audio_t=5, t_video=0.6, t_audio=0.4)]
    video, audio = _native(native, requests)
    for i, request in enumerate(requests):
        sigma_v, sigma_a = 1.0 - request.t_video, 1.0 - request.t_audio
        rollout_v, rollout_a = request_rows(requests, i, video, audio)
        roll = [_cps(rollout_v, request.video, sigma_v, sigma_v - 0.1, i, "video"),
                _cps(rollout_a, request.audio, sigma_a, sigma_a - 0.1, i, "audio")]
        replay_v, replay_a = _diffusers(diffusers, request)
        replay = [_cps(replay_v, request.video, sigma_v, sigma_v - 0.1, i, "video", roll[0].next_sample),
                  _cps(replay_a, request.audio, sigma_a, sigma_a - 0.1, i, "audio", roll[1].next_sample)]
        joint = [joint_log_prob(v.log_prob, a.log_prob, request.video.numel(), request.audio.numel(),
                                flavour="verl") for v, a in (roll, replay)]
        assert_bitwise_equal([roll[0].log_prob, roll[1].log_prob, joint[0]],
                             [replay[0].log_prob, replay[1].log_prob, joint[1]], f"request {i} CPS log-probs")


def test_harness_catches_attention_across_the_padding(engines, monkeypatch):
    diffusers, native = engines
    request = make_request(seed=1)

    def one_document(cu_seqlens, max_seqlen, total, **kwargs):
        return ((0, total),)

    monkeypatch.setattr(native_forward, "documents", one_document)
    with pytest.raises(AssertionError, match="not bitwise equal"):
        assert_bitwise_equal(_native(native, [request]), _diffusers(diffusers, request))


def test_harness_catches_fc1_halves_left_in_native_order(engines, monkeypatch):
    diffusers, native = engines
    request = make_request(seed=1, seq_len=25)
    swiglu = native_forward.swiglu
    monkeypatch.setattr(native_forward, "swiglu", lambda h: swiglu(torch.cat(h.chunk(2, dim=-1)[::-1], dim=-1)))
    with pytest.raises(AssertionError, match="not bitwise equal"):
        assert_bitwise_equal(_native(native, [request]), _diffusers(diffusers, request))


@pytest.mark.slow
def test_bitwise_equal_across_engines_on_the_triton_interpreter(engines):
    # The kernels a GPU rollout runs, interpreted (about 30 s of CPU): the engines agree on them too.
    diffusers, native = engines
    request = make_request(seed=14, seq_len=25)
    with flowlock.use_backend("triton"), flowlock.mode("strict") as frame:
        rollout, trainer = _native(native, [request]), _diffusers(diffusers, request)
    assert {backend for _, backend in frame.ran} == {"triton"}
    assert_bitwise_equal(rollout, trainer, "interpreted kernels: vLLM-Omni vs diffusers")
