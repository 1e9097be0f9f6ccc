"""verl-omni's MiniMax-H3 FlowGRPO rollout record -> the inputs of flowlock's strict replay.

verl-omni's H3 rollout attaches, per request, the selected CPS transitions and the packed layout
to its output; the trainer stacks requests into one ``tensordict.TensorDict`` of batch ``B`` and
cuts it into micro-batches. The fields read here (``K`` selected transitions, ``W = Nv·Cv + Na·Ca``
joint row width, ``cap`` the padded layout length, ``L`` the padded text length):

=========================  ==================  =========  ==========================================
key                        shape               dtype      meaning
=========================  ==================  =========  ==========================================
``all_latents``            ``(B, K, 1, W)``    float32    the sample each transition starts from
``all_next_latents``       ``(B, K, 1, W)``    float32    the sample it went to (the replay target)
``all_timesteps``          ``(B, K)``          float32    video timestep ``t = 1 - σ_video``
``h3_audio_timesteps``     ``(B, K)``          float32    audio timestep ``t = 1 - σ_audio``
``h3_step_indices``        ``(B, K)``          int64      the transition's index in the sigma grids
``h3_seq_len``             ``(B,)``/``(B, 1)`` int64      packed rows ``S`` of the request
``h3_video_rows``          ``(B,)``/``(B, 1)`` int64      ``Nv``
``h3_audio_rows``          ``(B,)``/``(B, 1)`` int64      ``Na``
``h3_position_ids``        ``(B, cap, 3)``     int/float  rotary positions, padded past ``S``
``h3_token_tags``          ``(B, cap)``        int64      modality tags, padded past ``S``
``h3_video_indices``       ``(B, Nv)``         int64      packed rows of the video rows
``h3_audio_indices``       ``(B, Na)``         int64      packed rows of the audio rows
``h3_text_indices``        ``(B, L)``          int64      packed rows of the text rows, padded
``prompt_embeds``          ``(B, L, D)``       any float  text hidden states, padded
``prompt_embeds_mask``     ``(B, L)``          int/bool   1 on the request's text rows
``h3_video_update_mask``   ``(B, Nv)``         bool       optional: video rows the sampler steps
``latent_meta``            ``(B, 6)``          int64      optional: ``[Nv, Na, t, h, w, audio_t]``
=========================  ==================  =========  ==========================================

:func:`replay_step` checks every field it reads (missing, shape, dtype, disagreement between fields
or across the micro-batch) and raises ``KeyError`` / ``TypeError`` / ``ValueError`` naming the key
before anything runs; it reads, never writes, the record. :func:`replay_log_prob` runs the model
and flowlock's CPS transitions on what it returns. Only ``t2va`` records are mapped: a request with
condition rows (an update mask with a ``False`` entry: FL2VA / Ref2VA) is refused.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from flowlock.models.minimax_h3.packing import AUDIO_TAG, VIDEO_TAG
from flowlock.ops._validate import INDEX_DTYPES, check_tensor
from flowlock.rl.minimax_h3 import H3Schedules
from flowlock.rl.transitions import TransitionResult, cps_step, joint_log_prob

REQUIRED_KEYS = (
    "all_latents", "all_next_latents", "all_timesteps", "h3_audio_timesteps", "h3_step_indices", "h3_seq_len",
    "h3_video_rows", "h3_audio_rows", "h3_position_ids", "h3_token_tags", "h3_video_indices", "h3_audio_indices",
    "h3_text_indices", "prompt_embeds", "prompt_embeds_mask",
)
LATENT_META_WIDTH = 6


@dataclass(frozen=True)
class ReplayStep:
    """One selected transition of a micro-batch of ``B`` requests sharing one layout.

    ``model_kwargs``: the keyword arguments of ``MiniMaxH3Transformer3DModel.forward`` (and of
    flowlock's strict forward): FP32 ``hidden_states (B, Nv, Cv)`` / ``audio_hidden_states
    (B, Na, Ca)``, the prompt's ``encoder_hidden_states (B, T, D)`` cut to its ``T`` text rows,
    ``timestep`` (the distinct values, ascending, float32) and the per-row ``timestep_indices``,
    and the layout (all int64 but the positions). ``next_video`` / ``next_audio``: the stored
    targets, shaped like the samples. ``sigma_*``: ``(B,)`` float32 from the actor's grids.
    ``grid_step``: the transition's index in those grids.
    """

    model_kwargs: dict[str, torch.Tensor]
    next_video: torch.Tensor
    next_audio: torch.Tensor
    sigma_video: torch.Tensor
    sigma_video_next: torch.Tensor
    sigma_audio: torch.Tensor
    sigma_audio_next: torch.Tensor
    grid_step: int


@dataclass(frozen=True)
class ReplayResult:
    """``log_prob`` ``(B,)`` float32: the joint 0.5/0.5 CPS log-prob; the two transitions' results."""

    log_prob: torch.Tensor
    video: TransitionResult
    audio: TransitionResult


def _field(record: Mapping, key: str) -> torch.Tensor:
    if key not in record.keys():
        raise KeyError(f"the H3 rollout record has no field {key!r}")
    value = record[key]
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"record[{key!r}] must be a torch.Tensor, got {type(value).__name__}")
    if value.is_nested:
        raise TypeError(f"record[{key!r}] is a nested tensor; pad it to one length per micro-batch first")
    return value


def _shared_int(record: Mapping, key: str, batch: int) -> int:
    value = check_tensor(f"record[{key!r}]", _field(record, key), dtypes=INDEX_DTYPES)
    if tuple(value.shape) not in ((batch,), (batch, 1)):
        raise ValueError(f"record[{key!r}] must have shape ({batch},) or ({batch}, 1), got {tuple(value.shape)}")
    values = value.reshape(-1).tolist()
    if len(set(values)) != 1:
        raise ValueError(f"record[{key!r}] differs across the micro-batch ({values}); H3 replays requests that "
                         "share one layout together")
    if values[0] < 1:
        raise ValueError(f"record[{key!r}] must be positive, got {values[0]}")
    return int(values[0])


def _shared_rows(record: Mapping, key: str, length: int, batch: int, dtypes, trailing: tuple = ()) -> torch.Tensor:
    """``record[key][:, :length]``, checked equal across the micro-batch; returns request 0's rows."""
    name = f"record[{key!r}]"
    value = check_tensor(name, _field(record, key), dtypes=dtypes, shape=(batch, None, *trailing))
    if value.shape[1] < length:
        raise ValueError(f"{name} holds {value.shape[1]} rows, the layout needs {length}")
    rows = value[:, :length]
    if not bool((rows == rows[:1]).all()):
        raise ValueError(f"{name} differs across the micro-batch; H3 replays requests that share one layout together")
    return rows[0]


def _check_permutation(index_rows: list[tuple[str, torch.Tensor]], seq_len: int) -> None:
    """The video, audio and text rows must cover ``[0, S)`` exactly once."""
    rows = torch.cat([r for _, r in index_rows])
    if rows.numel() != seq_len or not torch.equal(torch.sort(rows).values, torch.arange(seq_len)):
        names = ", ".join(f"record[{k!r}]" for k, _ in index_rows)
        raise ValueError(f"{names} must together cover the {seq_len} packed rows (record['h3_seq_len']) once each")


def _check_tags(tags: torch.Tensor, video: torch.Tensor, audio: torch.Tensor) -> None:
    if not bool((tags[video] == VIDEO_TAG).all()) or not bool((tags[audio] == AUDIO_TAG).all()):
        raise ValueError("record['h3_token_tags'] must tag the rows of record['h3_video_indices'] video (0) and "
                         "those of record['h3_audio_indices'] audio (2)")


def _check_latent_meta(record: Mapping, batch: int, video_rows: int, audio_rows: int) -> None:
    if "latent_meta" not in record.keys():
        return
    meta = check_tensor("record['latent_meta']", _field(record, "latent_meta"), dtypes=INDEX_DTYPES,
                        shape=(batch, LATENT_META_WIDTH))
    counts = meta[:, :2].tolist()
    if any(c != [video_rows, audio_rows] for c in counts):
        raise ValueError(f"record['latent_meta'] row counts {counts} disagree with record['h3_video_rows'] = "
                         f"{video_rows} and record['h3_audio_rows'] = {audio_rows}")


def _check_update_mask(record: Mapping, batch: int, video_rows: int) -> None:
    if "h3_video_update_mask" not in record.keys():
        return
    mask = check_tensor("record['h3_video_update_mask']", _field(record, "h3_video_update_mask"),
                        dtypes=(torch.bool,), shape=(batch, video_rows))
    if not bool(mask.all()):
        raise ValueError("record['h3_video_update_mask'] marks condition rows (FL2VA / Ref2VA): flowlock replays "
                         "t2va records only so far")


def _text_len(record: Mapping, batch: int) -> int:
    mask = check_tensor("record['prompt_embeds_mask']", _field(record, "prompt_embeds_mask"),
                        dtypes=(*INDEX_DTYPES, torch.bool), ndim=2)
    if mask.shape[0] != batch:
        raise ValueError(f"record['prompt_embeds_mask'] must have {batch} rows, got {tuple(mask.shape)}")
    lengths = mask.long().sum(dim=1)
    n = int(lengths[0])
    # The prompt's embeddings are padded at the end: the mask is ones, then zeros.
    prefix = torch.arange(mask.shape[1], device=mask.device) < n
    if not bool((lengths == n).all()) or not bool((mask.bool() == prefix).all()):
        raise ValueError(f"record['prompt_embeds_mask'] must mark the same prefix of text rows for every request, "
                         f"got lengths {lengths.tolist()}")
    if n < 1:
        raise ValueError("record['prompt_embeds_mask'] marks no text rows")
    return n


def _check_grid(schedules: H3Schedules, steps: torch.Tensor, t_video: torch.Tensor, t_audio: torch.Tensor) -> None:
    """Every recorded transition's timesteps are ``1 - σ`` of the actor's grids at its recorded grid step,
    bit for bit: the rollout and the actor must share the grids. All ``K`` transitions are checked, not
    only the replayed one: a grid with another step count agrees at grid step 0 (σ = 1 on every grid)
    and shows at any later one."""
    cpu_steps = steps.cpu().long()
    outside = (cpu_steps < 0) | (cpu_steps >= schedules.num_transitions)
    if bool(outside.any()):
        raise ValueError(f"record['h3_step_indices'] holds grid step {int(cpu_steps[outside][0])}, outside the actor's "
                         f"{schedules.num_transitions} transitions")
    for key, timesteps, grid in (("all_timesteps", t_video, schedules.video_sigmas),
                                 ("h3_audio_timesteps", t_audio, schedules.audio_sigmas)):
        expected = (1.0 - grid[cpu_steps]).to(torch.float32)
        wrong = timesteps.cpu() != expected
        if bool(wrong.any()):
            b, j = (int(i) for i in wrong.nonzero()[0])
            raise ValueError(f"record[{key!r}][{b}, {j}] = {float(timesteps[b, j])} is not 1 - sigma = "
                             f"{float(expected[b, j])} of grid step {int(cpu_steps[b, j])} ({schedules.convention!r} "
                             f"grid of {schedules.num_transitions} transitions): the rollout's sigma grid differs "
                             "from the actor's")


def replay_step(record: Mapping, transition: int, schedules: H3Schedules, *,
                row_widths: tuple[int, int]) -> ReplayStep:
    """Inputs of the actor's replay of selected transition ``transition`` (``0 <= transition < K``).

    ``record``: a micro-batch of the H3 FlowGRPO rollout record (a ``TensorDict`` or any mapping of
    the fields in the module docstring), on one device. ``schedules``: the actor's sigma grids (the
    rollout's are vLLM-Omni's ``convention="evaluations"`` grids with shifts 12 / 3). ``row_widths``:
    ``(Cv, Ca)``, the model's video and audio row widths (:func:`row_widths`).
    """
    if not isinstance(schedules, H3Schedules):
        raise TypeError(f"schedules must be flowlock.rl.H3Schedules, got {type(schedules).__name__}")
    if (not isinstance(row_widths, tuple) or len(row_widths) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) and w > 0 for w in row_widths)):
        raise ValueError(f"row_widths must be a tuple of two positive ints (Cv, Ca), got {row_widths!r}")
    cv, ca = row_widths
    missing = [key for key in REQUIRED_KEYS if key not in record.keys()]
    if missing:
        raise KeyError(f"the H3 rollout record has no field {', '.join(map(repr, missing))}")
    latents = check_tensor("record['all_latents']", _field(record, "all_latents"), dtypes=(torch.float32,), ndim=4)
    batch, selected = latents.shape[0], latents.shape[1]
    device = latents.device
    if isinstance(transition, bool) or not isinstance(transition, int) or not 0 <= transition < selected:
        raise ValueError(f"transition must be an int in [0, {selected}) (the record's selected transitions), "
                         f"got {transition!r}")
    video_rows = _shared_int(record, "h3_video_rows", batch)
    audio_rows = _shared_int(record, "h3_audio_rows", batch)
    seq_len = _shared_int(record, "h3_seq_len", batch)
    width = video_rows * cv + audio_rows * ca
    joint_shape = (batch, selected, 1, width)
    check_tensor("record['all_latents']", latents, shape=joint_shape)
    next_latents = check_tensor("record['all_next_latents']", _field(record, "all_next_latents"),
                                dtypes=(torch.float32,), shape=joint_shape, device=device)
    steps = check_tensor("record['h3_step_indices']", _field(record, "h3_step_indices"), dtypes=INDEX_DTYPES,
                         shape=(batch, selected))
    t_video = check_tensor("record['all_timesteps']", _field(record, "all_timesteps"), dtypes=(torch.float32,),
                           shape=(batch, selected))
    t_audio = check_tensor("record['h3_audio_timesteps']", _field(record, "h3_audio_timesteps"),
                           dtypes=(torch.float32,), shape=(batch, selected))
    _check_update_mask(record, batch, video_rows)
    _check_latent_meta(record, batch, video_rows, audio_rows)
    text_len = _text_len(record, batch)
    if video_rows + audio_rows + text_len != seq_len:
        raise ValueError(f"record['h3_seq_len'] = {seq_len} is not h3_video_rows + h3_audio_rows + text rows = "
                         f"{video_rows} + {audio_rows} + {text_len}")

    _check_grid(schedules, steps, t_video, t_audio)
    grid_steps = steps[:, transition].tolist()
    if len(set(grid_steps)) != 1:
        raise ValueError(f"record['h3_step_indices'][:, {transition}] differs across the micro-batch ({grid_steps})")
    grid_step = int(grid_steps[0])
    sv, sv_next = schedules.video_sigmas[grid_step], schedules.video_sigmas[grid_step + 1]
    sa, sa_next = schedules.audio_sigmas[grid_step], schedules.audio_sigmas[grid_step + 1]

    positions = _shared_rows(record, "h3_position_ids", seq_len, batch,
                             (*INDEX_DTYPES, torch.float32, torch.float64), trailing=(3,))
    tags = _shared_rows(record, "h3_token_tags", seq_len, batch, INDEX_DTYPES)
    video_index = _shared_rows(record, "h3_video_indices", video_rows, batch, INDEX_DTYPES).long()
    audio_index = _shared_rows(record, "h3_audio_indices", audio_rows, batch, INDEX_DTYPES).long()
    text_index = _shared_rows(record, "h3_text_indices", text_len, batch, INDEX_DTYPES).long()
    cpu_rows = [(k, r.cpu()) for k, r in (("h3_video_indices", video_index), ("h3_audio_indices", audio_index),
                                          ("h3_text_indices", text_index))]
    _check_permutation(cpu_rows, seq_len)
    _check_tags(tags.cpu(), cpu_rows[0][1], cpu_rows[1][1])
    prompt = check_tensor("record['prompt_embeds']", _field(record, "prompt_embeds"), ndim=3)
    if prompt.shape[0] != batch or prompt.shape[1] < text_len or not prompt.is_floating_point():
        raise ValueError(f"record['prompt_embeds'] must be a float (B={batch}, >= {text_len}, D) tensor, got "
                         f"{prompt.dtype} of shape {tuple(prompt.shape)}")

    # Every row of the request at its modality's timestep, as verl-omni's actor builds them: the
    # distinct values ascending and each row's index into them.
    row_t = torch.full((seq_len,), float(t_video[0, transition]), dtype=torch.float32)
    row_t[cpu_rows[1][1]] = t_audio[0, transition].cpu()
    timestep, timestep_indices = torch.unique(row_t, sorted=True, return_inverse=True)

    split = video_rows * cv
    current, target = latents[:, transition, 0], next_latents[:, transition, 0]
    full = lambda value: value.reshape(1).expand(batch).to(device=device, dtype=torch.float32).contiguous()
    kwargs = {
        "hidden_states": current[:, :split].reshape(batch, video_rows, cv),
        "audio_hidden_states": current[:, split:].reshape(batch, audio_rows, ca),
        "encoder_hidden_states": prompt[:, :text_len],
        "timestep": timestep.to(device),
        "timestep_indices": timestep_indices.to(device),
        "token_tags": tags.long(),
        "position_ids": positions,
        "video_indices": video_index,
        "audio_indices": audio_index,
        "text_indices": text_index,
    }
    return ReplayStep(
        model_kwargs=kwargs,
        next_video=target[:, :split].reshape(batch, video_rows, cv),
        next_audio=target[:, split:].reshape(batch, audio_rows, ca),
        sigma_video=full(sv), sigma_video_next=full(sv_next), sigma_audio=full(sa), sigma_audio_next=full(sa_next),
        grid_step=grid_step,
    )


def row_widths(model: nn.Module) -> tuple[int, int]:
    """``(Cv, Ca)`` of a diffusers ``MiniMaxH3Transformer3DModel``: video channels times the patch volume,
    audio channels."""
    config = model.config
    return int(config.in_channels * math.prod(config.patch_size)), int(config.audio_in_channels)


def replay_log_prob(model: nn.Module, step: ReplayStep, *, eta: float) -> ReplayResult:
    """The actor's replay of one transition: one forward of ``model`` on ``step.model_kwargs``, then the
    video and audio CPS steps (verl flavour, noise level ``eta``) with the stored next samples as
    targets, joined 0.5/0.5. Differentiable to the model's parameters through the velocities.

    Run it under ``flowlock.patch(model)`` (strict) for the rollout's bits; unpatched, this is the
    stock forward with flowlock's transition math.
    """
    video_v, audio_v = model(**step.model_kwargs, return_dict=False)
    video = cps_step(step.model_kwargs["hidden_states"], video_v.float(), step.sigma_video, step.sigma_video_next,
                     eta=eta, prev_sample=step.next_video)
    audio = cps_step(step.model_kwargs["audio_hidden_states"], audio_v.float(), step.sigma_audio,
                     step.sigma_audio_next, eta=eta, prev_sample=step.next_audio)
    log_prob = joint_log_prob(video.log_prob, audio.log_prob, step.next_video[0].numel(),
                              step.next_audio[0].numel(), flavour="verl")
    return ReplayResult(log_prob, video, audio)
