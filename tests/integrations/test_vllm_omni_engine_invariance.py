"""Engine invariance: vLLM-Omni + flowlock and diffusers + flowlock give the same bits.

The same weights (vLLM-Omni's ``load_weights`` from the diffusers state dict), the same request
(vLLM-Omni's own packer; the trainer replays the rollout's row order), in BF16 with H3's FP32
modules and in FP32 (every parameter and the prompt embeddings; the native model cast whole before
loading, as vLLM-Omni has no FP32 option): video and audio velocities, and the CPS log-probs of
``flowlock.rl`` computed from them, are bitwise equal across engines, for a request alone or packed
with others, padded or not. Every test runs in both dtypes, the planted faults included.
"""

from typing import NamedTuple

import pytest
import torch
from engine_inputs import diffusers_kwargs, make_request, native_kwargs, request_rows

import flowlock
import flowlock.integrations.vllm_omni.minimax_h3.forward as native_forward
import flowlock.models.minimax_h3.strict as diffusers_strict
from flowlock.integrations.vllm_omni.minimax_h3.replay import diffusers_requests
from flowlock.rl import cps_step, joint_log_prob, noise
from flowlock.testing import assert_bitwise_equal, assert_repeatable

REQUESTS = {
    "unpadded": dict(seed=1, seq_len=25),
    "padded": dict(seed=1),
    "keyframe": dict(seed=3, keyframe=True),
}


class Engines(NamedTuple):
    diffusers: torch.nn.Module
    native: torch.nn.Module
    dtype: torch.dtype


@pytest.fixture(params=["bf16", "fp32"])
def engines(request, engines):
    """Both engines, strict, in BF16 with the FP32 modules (``bf16``: conftest's ``engines``) or all
    FP32 (``fp32``)."""
    diffusers, native = engines if request.param == "bf16" else request.getfixturevalue("fp32_engines")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[request.param]
    # the models really are in that dtype: the BF16 set of each engine, and the returned velocities' path
    assert diffusers.context_embedder.weight.dtype == native.condition_proj.weight.dtype == dtype
    assert {p.dtype for p in native.blocks.parameters()} == {p.dtype for p in diffusers.transformer_blocks.parameters()
                                                             } == {dtype}
    return Engines(diffusers, native, dtype)


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
    diffusers, native, dtype = engines
    request = make_request(**REQUESTS[case], dtype=dtype)
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
    _, native, dtype = engines
    unpadded, padded = make_request(seed=4, seq_len=25, dtype=dtype), make_request(seed=4, dtype=dtype)
    assert padded.branch.seq_len == 64 > padded.branch.used_len == 25
    assert_bitwise_equal(_native(native, [padded]), _native(native, [unpadded]), "padded vs unpadded")


def test_packed_requests_bitwise_equal_to_each_alone_in_both_engines(engines):
    diffusers, native, dtype = engines
    requests = [make_request(seed=5, dtype=dtype),
                make_request(seed=6, text_len=7, latent_t=1, audio_t=3, t_video=0.7, t_audio=0.2, dtype=dtype),
                make_request(seed=7, keyframe=True, seq_len=41, dtype=dtype)]
    video, audio = _native(native, requests)
    for i, request in enumerate(requests):
        rows = request_rows(requests, i, video, audio)
        assert_bitwise_equal(rows, _native(native, [request]), f"request {i}: packed vs alone")
        assert_bitwise_equal(rows, _diffusers(diffusers, request), f"request {i}: packed vs diffusers")


def test_replay_splits_a_packed_forward_into_each_request_alone(engines):
    diffusers, native, dtype = engines
    requests = [make_request(seed=15, keyframe=True, dtype=dtype),
                make_request(seed=16, seq_len=30, text_len=4, dtype=dtype)]
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
    _, native, dtype = engines
    request = make_request(seed=8, dtype=dtype)
    reference = _native(native, [request])
    request.branch.prepare_rope_table(native)
    assert "rope_table" in request.branch.static_kwargs
    assert_bitwise_equal(_native(native, [request]), reference, "vLLM-Omni's prepared rope_table")


def test_packed_forward_bitwise_repeatable(engines):
    _, native, dtype = engines
    requests = [make_request(seed=9, dtype=dtype), make_request(seed=10, text_len=3, dtype=dtype)]
    assert_repeatable(lambda: _native(native, requests), runs=3)


def _cps(velocity, sample, sigma, sigma_next, sample_id, modality, prev=None):
    rows = sample[None]
    kwargs = {"prev_sample": prev} if prev is not None else {
        "noise": noise(11, sample_id, 0, modality, tuple(rows.shape))}
    return cps_step(rows, velocity[None], torch.tensor([sigma]), torch.tensor([sigma_next]), eta=0.8, **kwargs)


def test_cps_log_probs_of_a_packed_rollout_equal_the_diffusers_replay(engines):
    diffusers, native, dtype = engines
    requests = [make_request(seed=12, dtype=dtype),
                make_request(seed=13, text_len=6, audio_t=5, t_video=0.6, t_audio=0.4, dtype=dtype)]
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
    diffusers, native, dtype = engines
    request = make_request(seed=1, dtype=dtype)

    def one_document(cu_seqlens, max_seqlen, total, **kwargs):
        return ((0, total),)

    monkeypatch.setattr(native_forward, "documents", one_document)
    with pytest.raises(AssertionError, match="not bitwise equal"):
        assert_bitwise_equal(_native(native, [request]), _diffusers(diffusers, request))


def test_harness_catches_fc1_halves_left_in_native_order(engines, monkeypatch):
    diffusers, native, dtype = engines
    request = make_request(seed=1, seq_len=25, dtype=dtype)
    swiglu = native_forward.swiglu
    monkeypatch.setattr(native_forward, "swiglu", lambda h: swiglu(torch.cat(h.chunk(2, dim=-1)[::-1], dim=-1)))
    with pytest.raises(AssertionError, match="not bitwise equal"):
        assert_bitwise_equal(_native(native, [request]), _diffusers(diffusers, request))


def _one_ulp_up(t):
    # every element's bit pattern + 1: one ulp away from the value (for these finite activations)
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[t.dtype]
    return (t.view(bits) + 1).view(t.dtype)


@pytest.mark.parametrize("engine", ["diffusers", "vllm-omni"])
def test_harness_catches_one_ulp_in_either_engines_feed_forward(engines, monkeypatch, engine):
    # the shared block body holds only the order; each engine's own steps still decide the bits
    diffusers, native, dtype = engines
    request = make_request(seed=1, seq_len=25, dtype=dtype)
    module = diffusers_strict if engine == "diffusers" else native_forward
    swiglu = module.swiglu
    monkeypatch.setattr(module, "swiglu", lambda h: _one_ulp_up(swiglu(h)))
    with pytest.raises(AssertionError, match="not bitwise equal"):
        assert_bitwise_equal(_native(native, [request]), _diffusers(diffusers, request))


@pytest.mark.slow
def test_bitwise_equal_across_engines_on_the_triton_interpreter(engines):
    # The kernels a GPU rollout runs, interpreted (about 30 s of CPU): the engines agree on them too.
    diffusers, native, dtype = engines
    request = make_request(seed=14, seq_len=25, dtype=dtype)
    with flowlock.use_backend("triton"), flowlock.mode("strict") as frame:
        rollout, trainer = _native(native, [request]), _diffusers(diffusers, request)
    assert {backend for _, backend in frame.ran} == {"triton"}
    assert_bitwise_equal(rollout, trainer, "interpreted kernels: vLLM-Omni vs diffusers")


def test_fp32_rope_comes_from_the_positions_not_the_bf16_table(fp32_engines, monkeypatch):
    # vLLM-Omni's prepared table is always BF16; an FP32 model (both engines) keeps cos / sin FP32
    diffusers, native = fp32_engines
    request = make_request(seed=8, seq_len=25, dtype=torch.float32)
    request.branch.prepare_rope_table(native)
    kwargs = native_kwargs([request])
    assert kwargs["rope_table"].dtype == torch.bfloat16
    assert_bitwise_equal(_native(native, [request]), _diffusers(diffusers, request), "FP32 with a prepared table")
    # planted: the table used as given (cos / sin rounded to BF16) is caught
    monkeypatch.setattr(native_forward, "_model_rope", lambda model, inputs: native_forward.rope_from_table(
        inputs.rope_table))
    with pytest.raises(AssertionError, match="not bitwise equal"):
        assert_bitwise_equal(_native(native, [request]), _diffusers(diffusers, request))
    monkeypatch.undo()
    # a table that is not the one of these positions is refused
    kwargs["rope_table"] = kwargs["rope_table"].roll(1, dims=0).clone()
    with pytest.raises(ValueError, match="rope_table is not the BF16 table"), torch.no_grad():
        native(**kwargs)
