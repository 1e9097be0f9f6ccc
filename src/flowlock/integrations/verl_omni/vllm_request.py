"""One t2va request of verl-omni's H3 rollout, sampled strictly on vLLM-Omni's native H3 DiT.

What verl-omni's H3 rollout pipelines do inside ``diffuse`` for a text-to-video-and-audio request,
with flowlock's sampler (:func:`flowlock.integrations.verl_omni.rollout.cps_rollout`) in place of
theirs: vLLM-Omni packs the request (``minimax_h3_packed_sequence``, ``MiniMaxH3DenoiseBranch``),
the worker's DiT, which the vLLM plugin put on flowlock's strict path at load, gives the velocities,
and the record carries the layout verl-omni's actor reads plus the noise keys. The result is the
trajectory record :func:`flowlock.integrations.verl_omni.replay_step` replays to the same bits.

vLLM-Omni is imported when a request is sampled, never at import.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flowlock.integrations.verl_omni.noise import RequestNoise
from flowlock.integrations.verl_omni.rollout import RolloutResult, cps_rollout
from flowlock.integrations.vllm_omni import plugin
from flowlock.patching import active_patch
from flowlock.rl.minimax_h3 import AUDIO_SHIFT, VIDEO_SHIFT, h3_schedules

GRID_CONVENTION = "evaluations"


@dataclass(frozen=True)
class H3Request:
    """A t2va request as verl-omni's rollout pipeline receives it in ``diffuse``.

    ``text_embeddings (Nt, D)`` and ``text_tags (Nt,)`` from the pipeline's text encoder; the latent
    grid ``latent_t x latent_h x latent_w`` (before the 1x2x2 patch) and ``audio_t`` audio rows;
    ``num_steps`` grid points and the two shifts (H3's 12 / 3: other shifts are refused).
    """

    text_embeddings: torch.Tensor
    text_tags: torch.Tensor | None
    latent_t: int
    latent_h: int
    latent_w: int
    audio_t: int
    num_steps: int
    video_shift: float = VIDEO_SHIFT
    audio_shift: float = AUDIO_SHIFT


def native_row_widths(transformer: nn.Module) -> tuple[int, int]:
    """``(Cv, Ca)`` of vLLM-Omni's ``MiniMaxH3DiTModel``: latent channels times the patch volume, audio
    latent channels."""
    arch = transformer.arch
    return int(arch.latents_dim * math.prod(arch.patch_size)), int(arch.audio_latents_dim)


def _check_strict(transformer: nn.Module) -> None:
    # installed by the vLLM plugin at load, or by the caller's flowlock.integrations.vllm_omni.install
    if not plugin.installed(transformer) and active_patch(transformer) is None:
        raise RuntimeError(
            "the rollout worker's MiniMax-H3 DiT is not on flowlock's strict path: set "
            f"{plugin.SWITCH_ENV}=strict in the rollout workers' environment (the vLLM plugin installs flowlock "
            "at model load); the strict verl-omni rollout classes refuse to sample a stock DiT")


def _check_request(request: H3Request) -> None:
    if not (math.isclose(request.video_shift, VIDEO_SHIFT, rel_tol=0.0, abs_tol=0.0)
            and math.isclose(request.audio_shift, AUDIO_SHIFT, rel_tol=0.0, abs_tol=0.0)):
        raise ValueError(f"the strict H3 rollout samples on H3's grids (video shift {VIDEO_SHIFT}, audio shift "
                         f"{AUDIO_SHIFT}), got {request.video_shift} / {request.audio_shift}: the actor replays on "
                         "those grids")
    text = request.text_embeddings
    if not isinstance(text, torch.Tensor) or text.ndim != 2 or not text.is_floating_point():
        raise TypeError("text_embeddings must be a float (Nt, D) tensor")
    if request.text_tags is not None and tuple(request.text_tags.shape) != (text.shape[0],):
        raise ValueError(f"text_tags must have shape ({text.shape[0]},), got {tuple(request.text_tags.shape)}")


def _pad_rows(t: torch.Tensor, rows: int, what: str) -> torch.Tensor:
    if t.shape[0] > rows:
        raise ValueError(f"{what} has {t.shape[0]} rows, more than the record's cap {rows}")
    return F.pad(t, (0, 0) * (t.ndim - 1) + (0, rows - t.shape[0]))


def sample_request(transformer: nn.Module, request: H3Request, key: RequestNoise, *, selected: Collection[int],
                   eta: float, max_text_len: int) -> tuple[RolloutResult, dict[str, torch.Tensor]]:
    """Sample ``request`` on the worker's strict ``transformer`` (a vLLM-Omni ``MiniMaxH3DiTModel``).

    Returns the sampler's result (final rows and trajectory fields) and the layout fields of
    verl-omni's record (batch 1: ``h3_*``, ``prompt_embeds`` / ``prompt_embeds_mask`` padded to
    ``max_text_len``, ``h3_video_update_mask``, ``latent_meta``), all on the transformer's device.
    Raises before any forward when the DiT is not strict, the grid is not H3's or a field would not fit.
    """
    from vllm_omni.diffusion.models.minimax_h3.denoise_loop import MiniMaxH3DenoiseBranch
    from vllm_omni.diffusion.models.minimax_h3.packed_sequence import minimax_h3_packed_sequence

    _check_strict(transformer)
    _check_request(request)
    text = request.text_embeddings
    text_len = int(text.shape[0])
    if text_len > max_text_len:
        raise ValueError(f"the prompt has {text_len} text rows, more than max_sequence_length={max_text_len}")
    device = next(transformer.parameters()).device
    packed = minimax_h3_packed_sequence(text_len=text_len, latent_t=request.latent_t, latent_h=request.latent_h,
                                        latent_w=request.latent_w, audio_t=request.audio_t,
                                        include_keyframe_cond=False)
    tags = packed["token_tags"].clone()
    if request.text_tags is not None:
        tags[packed["text_pos"]] = request.text_tags.to(tags.device, tags.dtype)
    branch = MiniMaxH3DenoiseBranch(packed=packed, text_embeddings=text, token_tags=tags, device=device)

    def velocity(video_rows, audio_rows, t_video, t_audio):
        return transformer(**branch.forward_kwargs(video_rows=video_rows, audio_rows=audio_rows, t_video=t_video,
                                                   t_audio=t_audio, imgvid_cond_timestep=t_video,
                                                   audio_ref_cond_timestep=t_audio))

    nv, na = int(branch.img_pos.shape[0]), int(branch.audio_pos.shape[0])
    schedules = h3_schedules(request.num_steps, convention=GRID_CONVENTION)
    result = cps_rollout(velocity, key, rows=(nv, na), row_widths=native_row_widths(transformer),
                         schedules=schedules, selected=selected, eta=eta, device=device)
    seq_len = branch.used_len
    cap = nv + na + max_text_len
    layout = {
        "h3_seq_len": torch.tensor([seq_len], device=device),
        "h3_video_rows": torch.tensor([nv], device=device),
        "h3_audio_rows": torch.tensor([na], device=device),
        "h3_position_ids": _pad_rows(packed["img_position_ids"][:seq_len], cap, "h3_position_ids")[None].to(device),
        "h3_token_tags": _pad_rows(tags[:seq_len], cap, "h3_token_tags")[None].to(device),
        "h3_video_indices": branch.img_pos[None].to(device),
        "h3_audio_indices": branch.audio_pos[None].to(device),
        "h3_text_indices": _pad_rows(packed["text_pos"].view(-1), max_text_len, "h3_text_indices")[None].to(device),
        "h3_video_update_mask": torch.ones(1, nv, dtype=torch.bool, device=device),
        "prompt_embeds": _pad_rows(text, max_text_len, "prompt_embeds")[None].to(device),
        "prompt_embeds_mask": _pad_rows(torch.ones(text_len, dtype=torch.long), max_text_len,
                                        "prompt_embeds_mask")[None].to(device),
        "latent_meta": torch.tensor([[nv, na, request.latent_t, request.latent_h, request.latent_w, request.audio_t]],
                                    device=device),
    }
    return result, layout
