"""A FlowGRPO-CPS rollout of the tiny H3 that writes verl-omni's H3 rollout record.

Each request is sampled alone, as verl-omni's rollout samples it: vLLM-Omni's packed layout
(``engine_inputs.make_request``) and flowlock's strict sampling loop
(:func:`flowlock.integrations.verl_omni.rollout.cps_rollout`: keyed starting rows and SDE noise, CPS
steps, the joint 0.5/0.5 log-prob of the selected ones), one forward per grid step with the rollout's
own timestep convention (video rows index 0, audio rows index 1 of ``[t_video, t_audio]``). The
record carries the fields verl-omni's rollout writes (padded layout and prompt, ``latent_meta``)
plus the noise keys; :func:`stack` batches requests into the ``TensorDict`` the trainer cuts into
micro-batches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from engine_inputs import make_request, native_kwargs
from tensordict import TensorDict

from flowlock.integrations.verl_omni import RequestNoise, row_widths
from flowlock.integrations.verl_omni.rollout import cps_rollout
from flowlock.rl import h3_schedules

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

    def velocity(video_rows, audio_rows, t_video, t_audio):
        if native is None:
            timestep = torch.tensor([t_video, t_audio], dtype=torch.float32)
            v_video, v_audio = model(hidden_states=video_rows[None], audio_hidden_states=audio_rows[None],
                                     encoder_hidden_states=request.text[None], timestep=timestep,
                                     timestep_indices=timestep_indices, **layout, return_dict=False)
            return v_video[0], v_audio[0]
        request.video, request.audio = video_rows, audio_rows
        request.t_video, request.t_audio = t_video, t_audio
        return native(**native_kwargs([request]))

    result = cps_rollout(velocity, key, rows=(nv, na), row_widths=(cv, ca), schedules=sched, selected=selected,
                         eta=eta)
    cap = nv + na + MAX_TEXT_LEN
    return {
        **result.record,
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
    }


def stack(records: list[dict[str, torch.Tensor]]) -> TensorDict:
    """The trainer's batch: every field concatenated over requests, batch size ``len(records)``."""
    return TensorDict({k: torch.cat([r[k] for r in records]) for k in records[0]}, batch_size=[len(records)])
