"""The strict sampling loop of one verl-omni H3 rollout request, and the record it leaves.

verl-omni's H3 FlowGRPO rollout steps a request's video and audio rows through the CPS sampler:
on the selected transitions (the SDE window) with noise level ``eta`` and a log-prob, on the others
with ``eta = 0`` (the deterministic step). Its noise comes from one ``torch.Generator(seed + 1)`` per
request on the rollout's device, consumed video then audio at every step. Here the loop is the same
sampler with flowlock's pieces: the starting rows are ``flowlock.rl.initial_latents`` and the noise
of grid step ``k`` is :meth:`RequestNoise.step` (both pure functions of the request's key, the same
bits on any device), each step is ``flowlock.rl.transitions.cps_step`` and the log-prob is the
verl flavour's 0.5 · video + 0.5 · audio (``joint_log_prob``). The velocities come from a callable,
so the loop knows no engine: the vLLM-Omni rollout passes its (strict) DiT, a test the diffusers
model.

:func:`cps_rollout` returns the final rows and the trajectory fields of verl-omni's record
(``all_latents``, ``all_next_latents``, ``all_log_probs``, ``all_timesteps``, ``h3_audio_timesteps``,
``h3_step_indices``) plus the noise key fields, so that
:func:`flowlock.integrations.verl_omni.replay_step` / ``replay_log_prob`` replay each selected
transition to the same bits. With no selected transition it is the deterministic sampler DiffusionNFT's
strict rollout uses: the actor regenerates the clean sample from the key alone.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch

from flowlock.integrations.verl_omni.noise import RequestNoise
from flowlock.rl.minimax_h3 import H3Schedules
from flowlock.rl.noise import initial_latents
from flowlock.rl.transitions import cps_step, joint_log_prob

# (video rows (Nv, Cv), audio rows (Na, Ca), video timestep, audio timestep) -> (video, audio) velocities
Velocity = Callable[[torch.Tensor, torch.Tensor, float, float], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class RolloutResult:
    """``video (Nv, Cv)`` / ``audio (Na, Ca)`` float32: the request's final rows. ``record``: the
    trajectory fields (batch 1, on the rows' device; empty of transitions when none was selected)."""

    video: torch.Tensor
    audio: torch.Tensor
    record: dict[str, torch.Tensor]


def sde_window(num_transitions: int, *, window_size: int | None, window_range: tuple[int, int] | None = None,
               contiguous: bool = True, seed: int = 42) -> list[int]:
    """The grid steps that sample stochastically, as verl-omni's H3 rollout configures them: every
    transition when ``window_size`` is None; else ``window_size`` of them inside ``window_range``
    (default all), a contiguous run or a set, drawn by a CPU ``torch.Generator(seed)`` (the same on any
    host). Ascending."""
    if window_size is None:
        return list(range(num_transitions))
    low, high = window_range if window_range is not None else (0, num_transitions)
    high = min(int(high), num_transitions)
    size = int(window_size)
    if low < 0 or size <= 0 or high - low < size:
        raise ValueError(f"SDE window of size {size} does not fit range [{low}, {high}) of {num_transitions} "
                         "transitions")
    generator = torch.Generator().manual_seed(int(seed))
    if contiguous:
        start = int(torch.randint(low, high - size + 1, (1,), generator=generator))
        return list(range(start, start + size))
    return sorted(low + int(i) for i in torch.randperm(high - low, generator=generator)[:size])


def _check_selected(selected: Collection[int], num_transitions: int) -> frozenset[int]:
    steps = frozenset(selected)
    bad = [k for k in steps if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < num_transitions]
    if bad:
        raise ValueError(f"selected transitions {sorted(map(repr, bad))} are not grid steps in [0, {num_transitions})")
    return steps


def cps_rollout(velocity: Velocity, key: RequestNoise, *, rows: tuple[int, int], row_widths: tuple[int, int],
                schedules: H3Schedules, selected: Collection[int], eta: float,
                device: torch.device | str = "cpu") -> RolloutResult:
    """Sample one request from its keyed starting rows through every transition of ``schedules``.

    ``rows``: ``(Nv, Na)``; ``row_widths``: ``(Cv, Ca)``. Transition ``k`` is a CPS step with noise
    level ``eta`` and the key's grid-step-``k`` noise when ``k`` is in ``selected`` (its state, target
    and joint log-prob are recorded), with ``eta = 0`` and no draw otherwise. The velocities are
    evaluated at ``t = 1 - σ`` of each modality's grid (``schedules.video_timesteps[k]``, as float).
    Raises before any forward for a key, grid or selection that is not valid.
    """
    if not isinstance(key, RequestNoise):
        raise TypeError(f"key must be a RequestNoise, got {type(key).__name__}")
    if not isinstance(schedules, H3Schedules):
        raise TypeError(f"schedules must be flowlock.rl.H3Schedules, got {type(schedules).__name__}")
    chosen = _check_selected(selected, schedules.num_transitions)
    (nv, na), (cv, ca) = rows, row_widths
    video = initial_latents(key.seed, [key.sample_id], "video", (nv, cv), batch=1, device=device)
    audio = initial_latents(key.seed, [key.sample_id], "audio", (na, ca), batch=1, device=device)
    kept: dict[str, list] = {"current": [], "next": [], "log_prob": [], "step": []}
    for k in range(schedules.num_transitions):
        with torch.no_grad():
            v_video, v_audio = velocity(video[0], audio[0], float(schedules.video_timesteps[k]),
                                        float(schedules.audio_timesteps[k]))
        stochastic = k in chosen
        noise_v, noise_a = (key.step(k, (nv, cv), (na, ca), device=device) if stochastic
                            else (torch.zeros(nv, cv, device=device), torch.zeros(na, ca, device=device)))
        level = eta if stochastic else 0.0
        grid = lambda sigmas, i: sigmas[i].reshape(1).to(device)
        res_v = cps_step(video, v_video[None].float(), grid(schedules.video_sigmas, k),
                         grid(schedules.video_sigmas, k + 1), eta=level, noise=noise_v[None])
        res_a = cps_step(audio, v_audio[None].float(), grid(schedules.audio_sigmas, k),
                         grid(schedules.audio_sigmas, k + 1), eta=level, noise=noise_a[None])
        if stochastic:
            kept["current"].append(torch.cat([video.reshape(1, -1), audio.reshape(1, -1)], dim=1)[:, None])
            kept["next"].append(torch.cat([res_v.next_sample.reshape(1, -1), res_a.next_sample.reshape(1, -1)],
                                          dim=1)[:, None])
            kept["log_prob"].append(joint_log_prob(res_v.log_prob, res_a.log_prob, nv * cv, na * ca,
                                                   flavour="verl"))
            kept["step"].append(k)
        video, audio = res_v.next_sample, res_a.next_sample
    return RolloutResult(video[0], audio[0], {**_trajectory(kept, schedules, device), **key.record()})


def _trajectory(kept: dict[str, list], schedules: H3Schedules, device) -> dict[str, torch.Tensor]:
    if not kept["step"]:
        return {}
    steps = torch.tensor(kept["step"], dtype=torch.int64)
    return {
        "all_latents": torch.stack(kept["current"], dim=1),
        "all_next_latents": torch.stack(kept["next"], dim=1),
        "all_log_probs": torch.stack(kept["log_prob"], dim=1),
        "all_timesteps": (1.0 - schedules.video_sigmas[steps])[None].to(device),
        "h3_audio_timesteps": (1.0 - schedules.audio_sigmas[steps])[None].to(device),
        "h3_step_indices": steps[None].to(device),
    }
