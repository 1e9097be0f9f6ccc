"""One H3 forward's inputs for both engines, laid out by vLLM-Omni's own packer.

A :class:`Request` is one rollout request: vLLM-Omni's ``minimax_h3_packed_sequence`` layout
(text | keyframe condition | audio | video | padding to a multiple of 64, or to an exact length),
its ``MiniMaxH3DenoiseBranch``, seeded latents and prompt embeddings. The native kwargs come from
vLLM-Omni's ``forward_kwargs`` (one request) or ``minimax_h3_batched_forward_kwargs`` (several
packed); the diffusers kwargs are the same request alone and unpadded, rows in the same order
(verl-omni replays the rollout's layout in the trainer), with its own distinct timesteps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm_omni.diffusion.models.minimax_h3.batched_packing import minimax_h3_batched_forward_kwargs
from vllm_omni.diffusion.models.minimax_h3.denoise_loop import MiniMaxH3DenoiseBranch
from vllm_omni.diffusion.models.minimax_h3.packed_sequence import minimax_h3_packed_sequence

from flowlock.models.minimax_h3 import TINY_H3_CONFIG

# vLLM-Omni's packer writes H3's row widths (24 latent channels x 2 x 2 patch = 96, audio 32).
ENGINE_CONFIG = {**TINY_H3_CONFIG, "in_channels": 24, "audio_in_channels": 32}
CONDITION_TIMESTEP, AUDIO_REFERENCE_TIMESTEP = 0.999, 1.0


@dataclass
class Request:
    branch: MiniMaxH3DenoiseBranch
    text: torch.Tensor  # (Nt, text_dim) in the models' dtype (bf16, or fp32 for the all-FP32 models)
    video: torch.Tensor  # (Nv, 96) fp32, condition rows first
    audio: torch.Tensor  # (Na, 32) fp32
    t_video: float
    t_audio: float


def make_request(seed: int, *, text_len: int = 5, latent_t: int = 2, latent_hw: tuple[int, int] = (4, 6),
                 audio_t: int = 4, seq_len: int | None = None, keyframe: bool = False,
                 t_video: float = 0.3, t_audio: float = 0.55, dtype: torch.dtype = torch.bfloat16) -> Request:
    """A request packed by vLLM-Omni: aligned to 64 rows unless ``seq_len`` (e.g. the used rows) is given;
    ``keyframe`` adds a first-frame condition block (FL2VA), whose rows the native model zeroes.
    ``dtype``: of the prompt embeddings (the text encoder's output dtype; latents are always FP32)."""
    packed = minimax_h3_packed_sequence(
        text_len=text_len, latent_t=latent_t, latent_h=latent_hw[0], latent_w=latent_hw[1], audio_t=audio_t,
        include_keyframe_cond=keyframe, keyframe_frame_indices=[0] if keyframe else None,
        frame_count=4 * latent_t - 3 if keyframe else None, seq_len=seq_len)
    gen = torch.Generator().manual_seed(seed)
    text = torch.randn(text_len, ENGINE_CONFIG["text_dim"], generator=gen).to(dtype)
    video = torch.randn(packed["img_pos"].numel(), 96, generator=gen)
    audio = torch.randn(packed["audio_pos"].numel(), 32, generator=gen)
    branch = MiniMaxH3DenoiseBranch(packed=packed, text_embeddings=text, token_tags=packed["token_tags"],
                                    device=torch.device("cpu"))
    return Request(branch, text, video, audio, t_video, t_audio)


def used_rows(request: Request) -> int:
    return request.branch.used_len


def native_kwargs(requests: list[Request]) -> dict:
    """vLLM-Omni's forward kwargs for ``requests`` packed in order (one request: its branch's own)."""
    return minimax_h3_batched_forward_kwargs(
        branches=[r.branch for r in requests], video_rows=[r.video for r in requests],
        audio_rows=[r.audio for r in requests], t_video=[r.t_video for r in requests],
        t_audio=[r.t_audio for r in requests], imgvid_cond_timesteps=[CONDITION_TIMESTEP] * len(requests),
        audio_ref_cond_timesteps=[AUDIO_REFERENCE_TIMESTEP] * len(requests))


def diffusers_kwargs(request: Request) -> dict:
    """``MiniMaxH3Transformer3DModel.forward`` kwargs for ``request`` alone, without its padding rows."""
    native = native_kwargs([request])
    used = used_rows(request)
    timesteps = native["unique_timesteps"][native["inverse_indices"][:used]]
    timestep, indices = torch.unique(timesteps, sorted=True, return_inverse=True)
    return dict(
        hidden_states=request.video[None], audio_hidden_states=request.audio[None],
        encoder_hidden_states=request.text[None], timestep=timestep, timestep_indices=indices,
        token_tags=native["token_tags"][:used].clone(), position_ids=native["img_position_ids"][0, :used].clone(),
        video_indices=request.branch.img_pos.clone(), audio_indices=request.branch.audio_pos.clone(),
        text_indices=request.branch.text_pos_dev.clone())


def request_rows(requests: list[Request], index: int, video: torch.Tensor, audio: torch.Tensor):
    """Request ``index``'s rows of a packed forward's ``(video, audio)`` outputs (request order)."""
    v0 = sum(r.video.shape[0] for r in requests[:index])
    a0 = sum(r.audio.shape[0] for r in requests[:index])
    r = requests[index]
    return video[v0:v0 + r.video.shape[0]], audio[a0:a0 + r.audio.shape[0]]
