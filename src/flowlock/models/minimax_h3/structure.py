"""Validation of the structural inputs of one H3 forward, done once before any op runs.

The ops called afterwards get ``check_indices=False``: their index arguments were checked here.
"""

from __future__ import annotations

import torch

from flowlock.ops._validate import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_finite_range,
    check_index,
    check_tensor,
    memoized_over,
)


def validate_structure(*, hidden_states: torch.Tensor, audio_hidden_states: torch.Tensor,
                       encoder_hidden_states: torch.Tensor, timestep: torch.Tensor,
                       timestep_indices: torch.Tensor, token_tags: torch.Tensor, position_ids: torch.Tensor,
                       video_indices: torch.Tensor, audio_indices: torch.Tensor,
                       text_indices: torch.Tensor) -> int:
    """Check one packed layout and its inputs; return the sequence length S.

    Raises ValueError / TypeError naming the argument for: a ``position_ids`` that is not (S, 3);
    per-row tensors not of length S; a timestep outside [0, 1] or not finite; ``timestep_indices``
    outside [0, T); tags outside {0, 1, 2}; row indices out of [0, S), repeated or shared between
    modalities; latents whose batch sizes differ or whose row counts do not match their indices.
    """
    check_tensor("position_ids", position_ids, ndim=2)
    if position_ids.shape[1] != 3:
        raise ValueError(f"position_ids must have shape (S, 3), got {tuple(position_ids.shape)}")
    seq_len = position_ids.shape[0]
    device = position_ids.device
    check_tensor("timestep", timestep, dtypes=FLOAT_DTYPES, ndim=1, device=device)
    if timestep.shape[0] < 1:
        raise ValueError("timestep must hold at least one value")
    check_finite_range("timestep", timestep, 0.0, 1.0)
    check_index("timestep_indices", timestep_indices, length=seq_len, upper=timestep.shape[0], device=device)
    check_index("token_tags", token_tags, length=seq_len, upper=3, device=device)
    batch = None
    rows = []
    for name, latents, index_name, index in (
            ("hidden_states", hidden_states, "video_indices", video_indices),
            ("audio_hidden_states", audio_hidden_states, "audio_indices", audio_indices),
            ("encoder_hidden_states", encoder_hidden_states, "text_indices", text_indices)):
        check_tensor(name, latents, dtypes=FLOAT_DTYPES, ndim=3, device=device)
        batch = latents.shape[0] if batch is None else batch
        if latents.shape[0] != batch:
            raise ValueError(f"{name} has batch {latents.shape[0]}, hidden_states has {batch}")
        check_index(index_name, index, length=latents.shape[1], upper=seq_len, device=device)
        rows.append(index)
    # A host read-back (it drains the launch queue): memoized, so a layout reused across steps pays once.
    if not memoized_over(rows, "disjoint_rows", lambda: _unique_rows(rows)):
        raise ValueError("video_indices, audio_indices and text_indices must be unique and disjoint")
    if position_ids.dtype not in INDEX_DTYPES and not position_ids.is_floating_point():
        raise TypeError(f"position_ids must be an integer or float tensor, got {position_ids.dtype}")
    return seq_len


def _unique_rows(indices: list[torch.Tensor]) -> bool:
    every = torch.cat([i.to(torch.int64) for i in indices])
    return every.numel() == 0 or torch.unique(every).numel() == every.numel()


def module_class(module: object) -> type:
    """The module's own class. FSDP2's ``fully_shard`` swaps in a generated subclass
    ``(FSDPModule, cls)`` that adds sharding hooks, not arithmetic, so it counts as ``cls``."""
    from torch.distributed.fsdp import FSDPModule

    cls = type(module)
    if len(cls.__bases__) == 2 and cls.__bases__[0] is FSDPModule:
        return cls.__bases__[1]
    return cls
