"""The trainer's view of a rollout forward: vLLM-Omni's packed kwargs as diffusers kwargs per request.

verl-omni replays each rollout request in the diffusers trainer with the rollout's layout. Given
the keyword arguments of one ``MiniMaxH3DiTModel.forward`` (one request, or several packed by
``minimax_h3_batched_forward_kwargs``), :func:`diffusers_requests` returns, per request, the
``MiniMaxH3Transformer3DModel.forward`` kwargs of that request alone (batch 1): its real rows in
the same order (padding rows dropped), row indices relative to the request, and its own distinct
timesteps. With both engines under flowlock's strict path, the diffusers outputs for a request are
the bits of that request's rows of the packed vLLM-Omni outputs (condition rows aside, which
vLLM-Omni returns multiplied by ``update_mask``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowlock.integrations.vllm_omni.minimax_h3.inputs import documents, parse_inputs


@dataclass(frozen=True)
class ReplayRequest:
    """One request of a packed forward: its diffusers kwargs, where its rows sit in the native outputs
    (``video_rows`` / ``audio_rows``: slices of the returned video / audio rows) and its ``update_mask``."""

    kwargs: dict
    video_rows: slice
    audio_rows: slice
    update_mask: torch.Tensor | None


def _within(index: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    return (index >= start) & (index < stop)


def diffusers_requests(native_kwargs: dict) -> list[ReplayRequest]:
    """Split one vLLM-Omni forward's kwargs into per-request diffusers kwargs.

    A request is a document of ``packed_seq_params.cu_seqlens_q`` holding a non-padding row; its
    video, audio and text rows must be contiguous runs of the packed index lists (as vLLM-Omni's
    packers lay them out) and the returned video rows must be its video rows in order. Raises
    ValueError otherwise, and for anything :func:`parse_inputs` refuses.
    """
    x, audio_x = native_kwargs.get("x"), native_kwargs.get("audio_x")
    widths = [t.shape[-1] if isinstance(t, torch.Tensor) else 0 for t in (x, audio_x)]
    inputs = parse_inputs(native_kwargs, *widths)
    docs = documents(inputs.cu_seqlens, inputs.max_seqlen, inputs.seq_len, prefix_request=inputs.num_requests == 1)
    if not torch.equal(inputs.out_pos, inputs.img_pos):
        raise ValueError("replay needs img_pos_for_infer_output_info equal to img_pos_info")
    requests = []
    for start, stop in docs:
        if bool((inputs.token_tags[start:stop] == -1).all()):
            continue
        picks = [_within(index, start, stop).nonzero().flatten()
                 for index in (inputs.img_pos, inputs.audio_pos, inputs.text_pos)]
        runs = []
        for name, pick in zip(("img_pos_info", "audio_pos_info", "text_pos_info"), picks):
            lo, hi = (int(pick[0]), int(pick[-1]) + 1) if pick.numel() else (0, 0)
            if hi - lo != pick.numel():
                raise ValueError(f"{name}: the rows of the request at [{start}, {stop}) are not one contiguous run")
            runs.append(slice(lo, hi))
        video, audio, text = runs
        real = inputs.token_tags[start:stop] != -1
        rows = real.nonzero().flatten()
        if rows.numel() != int(rows[-1]) + 1:
            raise ValueError(f"the request at [{start}, {stop}) has padding rows before real ones")
        used = rows.numel()
        timestep, indices = torch.unique(inputs.unique_timesteps[inputs.inverse_indices[start:start + used]],
                                         sorted=True, return_inverse=True)
        kwargs = dict(
            hidden_states=inputs.x[0, inputs.img_pos[video]][None],
            audio_hidden_states=inputs.audio_x[0, inputs.audio_pos[audio]][None],
            encoder_hidden_states=inputs.prompt_embeds[text][None], timestep=timestep, timestep_indices=indices,
            token_tags=inputs.token_tags[start:start + used].clone(),
            position_ids=inputs.img_position_ids[0, start:start + used].clone(),
            video_indices=inputs.img_pos[video] - start, audio_indices=inputs.audio_pos[audio] - start,
            text_indices=inputs.text_pos[text] - start)
        mask = None if inputs.update_mask is None else inputs.update_mask[video]
        requests.append(ReplayRequest(kwargs, video, audio, mask))
    return requests
