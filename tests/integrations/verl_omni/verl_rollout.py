"""A FlowGRPO-CPS rollout of the tiny H3 that writes verl-omni's H3 rollout record.

Each request is sampled alone, as verl-omni's rollout samples it: vLLM-Omni's packed layout
(``engine_inputs.make_request``), flowlock's keyed initial latents and SDE noise, one forward per grid
step with the rollout's own timestep convention (video rows index 0, audio rows index 1 of
``[t_video, t_audio]``), a CPS step per modality (``eta`` on the selected steps, 0 elsewhere) and the
joint 0.5/0.5 log-prob of the selected ones. The record carries the fields verl-omni's rollout writes
(padded layout and prompt, ``latent_meta``) plus the noise keys; :func:`stack` batches requests into
the ``TensorDict`` the trainer cuts into micro-batches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from engine_inputs import make_request, native_kwargs
from tensordict import TensorDict

from flowlock.integrations.verl_omni import RequestNoise, row_widths
from flowlock.rl import h3_schedules, initial_latents
from flowlock.rl.transitions import cps_step, joint_log_prob

MAX_TEXT_LEN = 8


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return F.pad(t, (0, 0) * (t.ndim - 1) + (0, rows - t.shape[0]))


def rollout_record(model, key: RequestNoise, *, prompt_seed: int, num_steps: int, selected: set[int],
                   eta: float, native=None) -> dict[str, torch.Tensor]:
    """One request's record (every field with batch 1). ``model``: a diffusers H3 (patched or not), which
    computes the velocities unless ``native`` (a vLLM-Omni ``MiniMaxH3DiTModel``) is given: then the
    native model does, on vLLM-Omni's own forward kwargs for the request (padded to 64 rows)."""
    request = make_request(prompt_seed)
    branch = request.branch
    seq_len = branch.used_len
    cv, ca = row_widths(model)
    nv, na, nt = branch.img_pos.numel(), branch.audio_pos.numel(), branch.text_pos_dev.numel()
    sched = h3_schedules(num_steps, convention="evaluations")
    positions = branch.static_kwargs["img_position_ids"][0, :seq_len]  # float64, as vLLM-Omni packs them
    tags = branch.static_kwargs["token_tags"][:seq_len]
    layout = dict(token_tags=tags.clone(), position_ids=positions.clone(), video_indices=branch.img_pos.clone(),
                  audio_indices=branch.audio_pos.clone(), text_indices=branch.text_pos_dev.clone())
    audio_rows = torch.zeros(seq_len, dtype=torch.bool)
    audio_rows[branch.audio_pos] = True
    timestep_indices = audio_rows.long()

    video = initial_latents(key.seed, [key.sample_id], "video", (nv, cv), batch=1)
    audio = initial_latents(key.seed, [key.sample_id], "audio", (na, ca), batch=1)
    kept = {"current": [], "next": [], "log_prob": [], "step": []}
    for k in range(sched.num_transitions):
        timestep = torch.stack([sched.video_timesteps[k], sched.audio_timesteps[k]])
        with torch.no_grad():
            if native is None:
                v_video, v_audio = model(hidden_states=video, audio_hidden_states=audio,
                                         encoder_hidden_states=request.text[None], timestep=timestep,
                                         timestep_indices=timestep_indices, **layout, return_dict=False)
            else:
                request.video, request.audio = video[0], audio[0]
                request.t_video, request.t_audio = float(timestep[0]), float(timestep[1])
                v_video, v_audio = (v[None] for v in native(**native_kwargs([request])))
        noise_v, noise_a = key.step(k, (nv, cv), (na, ca))
        level = eta if k in selected else 0.0
        one = lambda grid, i: grid[i].reshape(1)
        res_v = cps_step(video, v_video.float(), one(sched.video_sigmas, k), one(sched.video_sigmas, k + 1),
                         eta=level, noise=noise_v[None])
        res_a = cps_step(audio, v_audio.float(), one(sched.audio_sigmas, k), one(sched.audio_sigmas, k + 1),
                         eta=level, noise=noise_a[None])
        if k in selected:
            kept["current"].append(torch.cat([video.reshape(1, -1), audio.reshape(1, -1)], dim=1)[:, None])
            kept["next"].append(torch.cat([res_v.next_sample.reshape(1, -1), res_a.next_sample.reshape(1, -1)],
                                          dim=1)[:, None])
            kept["log_prob"].append(joint_log_prob(res_v.log_prob, res_a.log_prob, nv * cv, na * ca,
                                                   flavour="verl"))
            kept["step"].append(k)
        video, audio = res_v.next_sample, res_a.next_sample

    steps = torch.tensor(kept["step"], dtype=torch.int64)
    cap = nv + na + MAX_TEXT_LEN
    return {
        "all_latents": torch.stack(kept["current"], dim=1),
        "all_next_latents": torch.stack(kept["next"], dim=1),
        "all_log_probs": torch.stack(kept["log_prob"], dim=1),
        "all_timesteps": (1.0 - sched.video_sigmas[steps])[None],
        "h3_audio_timesteps": (1.0 - sched.audio_sigmas[steps])[None],
        "h3_step_indices": steps[None],
        "h3_seq_len": torch.tensor([seq_len]),
        "h3_video_rows": torch.tensor([nv]),
        "h3_audio_rows": torch.tensor([na]),
        "h3_position_ids": _pad_rows(layout["position_ids"], cap)[None],
        "h3_token_tags": _pad_rows(tags, cap)[None],
        "h3_video_indices": branch.img_pos[None].clone(),
        "h3_audio_indices": branch.audio_pos[None].clone(),
        "h3_text_indices": _pad_rows(branch.text_pos_dev.view(-1), MAX_TEXT_LEN)[None],
        "h3_video_update_mask": torch.ones(1, nv, dtype=torch.bool),
        "prompt_embeds": _pad_rows(request.text, MAX_TEXT_LEN)[None],
        "prompt_embeds_mask": _pad_rows(torch.ones(nt, dtype=torch.long), MAX_TEXT_LEN)[None],
        "latent_meta": torch.tensor([[nv, na, 2, 4, 6, 4]]),
        **key.record(),
    }


def stack(records: list[dict[str, torch.Tensor]]) -> TensorDict:
    """The trainer's batch: every field concatenated over requests, batch size ``len(records)``."""
    return TensorDict({k: torch.cat([r[k] for r in records]) for k in records[0]}, batch_size=[len(records)])
