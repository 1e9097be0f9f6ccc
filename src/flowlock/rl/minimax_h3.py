"""MiniMax-H3's sigma schedules: a video and an audio grid per request, stepped together.

H3 shifts the video grid by 12 and the audio grid by 3 (the generic grid is
:func:`flowlock.rl.schedules.sigma_grid`) and runs both modalities in one forward per transition.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowlock.rl.schedules import sigma_grid, timesteps_from_sigmas

VIDEO_SHIFT = 12.0
AUDIO_SHIFT = 3.0


@dataclass(frozen=True)
class H3Schedules:
    """The two per-modality grids of one H3 request (float32, CPU) and their timesteps."""

    video_sigmas: torch.Tensor
    audio_sigmas: torch.Tensor
    convention: str

    @property
    def num_transitions(self) -> int:
        return int(self.video_sigmas.numel()) - 1

    @property
    def video_timesteps(self) -> torch.Tensor:
        return timesteps_from_sigmas(self.video_sigmas)

    @property
    def audio_timesteps(self) -> torch.Tensor:
        return timesteps_from_sigmas(self.audio_sigmas)


def h3_schedules(num_steps: int, *, convention: str, video_shift: float = VIDEO_SHIFT,
                 audio_shift: float = AUDIO_SHIFT) -> H3Schedules:
    """Video (shift 12) and audio (shift 3) grids of one request.

    Raises ``ValueError`` when collapsing left the two grids with different lengths: H3 steps both
    modalities in one forward per transition, so the transition counts must agree.
    """
    video = sigma_grid(num_steps, video_shift, convention=convention)
    audio = sigma_grid(num_steps, audio_shift, convention=convention)
    if video.numel() != audio.numel():
        raise ValueError(f"num_steps={num_steps}: the video grid has {video.numel()} points and the audio grid "
                         f"{audio.numel()} after collapsing duplicates; the transition counts must agree")
    return H3Schedules(video, audio, convention)
