"""The packing of one MiniMax-H3 request: which rows of the packed sequence hold which modality.

A request is one attention document of ``S`` rows: text rows, then video rows, then audio rows.
Every row carries a modality tag (0 video, 1 text, 2 audio), the index of its timestep in the
forward's distinct ``timestep`` tensor, and ``(t, h, w)`` rotary coordinates. Video and text rows
use timestep 0 (the video noise level) and audio rows timestep 1, as in H3's two-schedule sampler.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

VIDEO_TAG, TEXT_TAG, AUDIO_TAG = 0, 1, 2


@dataclass(frozen=True)
class H3Packing:
    """Index tensors of one packing (all int64, on one device)."""

    timestep_indices: torch.Tensor  # (S,)
    token_tags: torch.Tensor  # (S,)
    position_ids: torch.Tensor  # (S, 3)
    video_indices: torch.Tensor  # (Nv,)
    audio_indices: torch.Tensor  # (Na,)
    text_indices: torch.Tensor  # (Nt,)

    @property
    def seq_len(self) -> int:
        return int(self.token_tags.shape[0])

    def to(self, device: torch.device | str) -> H3Packing:
        return H3Packing(*(getattr(self, f).to(device) for f in self.__dataclass_fields__))

    def model_kwargs(self) -> dict[str, torch.Tensor]:
        """The structural keyword arguments of ``MiniMaxH3Transformer3DModel.forward``."""
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


def build_packing(num_text: int, latent_t: int, latent_h: int, latent_w: int, audio_rows: int) -> H3Packing:
    """Text rows, then a ``latent_t x latent_h x latent_w`` video grid, then ``audio_rows`` audio rows."""
    if min(num_text, latent_t, latent_h, latent_w, audio_rows) < 1:
        raise ValueError("every modality needs at least one row")
    num_video = latent_t * latent_h * latent_w
    s = num_text + num_video + audio_rows
    tags = torch.cat([
        torch.full((num_text,), TEXT_TAG), torch.full((num_video,), VIDEO_TAG), torch.full((audio_rows,), AUDIO_TAG)
    ]).long()
    ts_index = (tags == AUDIO_TAG).long()
    grid = torch.stack(torch.meshgrid(
        torch.arange(latent_t), torch.arange(latent_h), torch.arange(latent_w), indexing="ij"), dim=-1).reshape(-1, 3)
    text_pos = torch.zeros(num_text, 3, dtype=torch.long)
    audio_pos = torch.stack([torch.arange(audio_rows), torch.zeros(audio_rows, dtype=torch.long),
                             torch.zeros(audio_rows, dtype=torch.long)], dim=-1)
    positions = torch.cat([text_pos, grid.long(), audio_pos]).long()
    ar = torch.arange(s)
    return H3Packing(
        timestep_indices=ts_index,
        token_tags=tags,
        position_ids=positions,
        video_indices=ar[num_text:num_text + num_video].clone(),
        audio_indices=ar[num_text + num_video:].clone(),
        text_indices=ar[:num_text].clone(),
    )


def packing_for_length(seq: int) -> H3Packing:
    """A packing of exactly ``seq`` rows: text ~5%, audio ~15% (absorbing the rounding), video the
    rest on a ``(t, h, w)`` grid of square frames."""
    text, audio = max(1, round(0.05 * seq)), max(1, round(0.15 * seq))
    video = seq - text - audio
    for hw in (64, 16, 4, 1):
        if video >= 4 * hw:
            side = math.isqrt(hw)
            t = video // hw
            return build_packing(text, t, side, side, seq - text - t * hw)
    raise ValueError(f"a sequence of {seq} rows is too short for a three-modality packing")
