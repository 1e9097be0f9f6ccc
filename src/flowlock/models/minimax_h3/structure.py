"""Validation of the structural inputs of one H3 forward, done once before any op runs.

The ops called afterwards get ``check_indices=False``: their index arguments were checked here.
Eagerly the value checks (index ranges, disjoint rows, timestep range) read values back to the host,
memoized per tensor; under ``torch.compile`` a host read-back would break the graph, so the same
checks run inside the graph as ``torch._assert_async`` (a ``RuntimeError`` naming the argument on
the CPU, a device-side assert on CUDA) while types, ranks and shapes are checked at trace time.
"""

from __future__ import annotations

import torch

from flowlock.models.minimax_h3.positions import check_positions
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
    """Check one packing and its inputs; return the sequence length S.

    Raises ValueError / TypeError naming the argument for: a ``position_ids`` that is not (S, 3);
    per-row tensors not of length S; a timestep that is not float32 (TypeError: diffusers would upcast
    it, flowlock refuses, see ``timestep_sinusoid``), outside [0, 1] or not finite; ``timestep_indices``
    outside [0, T); tags outside {0, 1, 2}; positions outside [-2**24, 2**24] or not finite; row indices out
    of [0, S), repeated or shared between modalities; latents whose batch sizes differ or whose row
    counts do not match their indices.
    Under ``torch.compile`` the value checks raise ``RuntimeError`` with the same messages instead.
    """
    eager = not torch.compiler.is_compiling()
    check_tensor("position_ids", position_ids, ndim=2)
    if position_ids.shape[1] != 3:
        raise ValueError(f"position_ids must have shape (S, 3), got {tuple(position_ids.shape)}")
    seq_len = position_ids.shape[0]
    device = position_ids.device
    if isinstance(timestep, torch.Tensor) and timestep.is_floating_point() and timestep.dtype != torch.float32:
        # diffusers upcasts with .float(); flowlock refuses instead (timestep_sinusoid's contract): a bf16
        # timestep near t = 1 has already lost ~40% of the relative precision of sigma = 1 - t.
        raise TypeError(f"timestep must be float32, got {timestep.dtype}: flowlock does not cast the "
                        "timestep as diffusers does (a bf16 / fp16 timestep near t = 1 has already lost much of "
                        "the precision of sigma = 1 - t); keep timesteps float32 when casting the other inputs")
    check_tensor("timestep", timestep, dtypes=(torch.float32,), ndim=1, device=device)
    if timestep.shape[0] < 1:
        raise ValueError("timestep must hold at least one value")
    if eager:
        check_finite_range("timestep", timestep, 0.0, 1.0)
    else:
        torch._assert_async((torch.isfinite(timestep) & (timestep >= 0.0) & (timestep <= 1.0)).all(),
                            "timestep values must lie in [0.0, 1.0]")
    ranges = [("timestep_indices", timestep_indices, seq_len, timestep.shape[0]),
              ("token_tags", token_tags, seq_len, 3)]
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
        ranges.append((index_name, index, latents.shape[1], seq_len))
        rows.append(index)
    for index_name, index, length, upper in ranges:
        check_index(index_name, index, length=length, upper=upper, device=device, check_range=eager)
        if not eager and index.numel():
            torch._assert_async(((index >= 0) & (index < upper)).all(), f"{index_name} values must lie in [0, {upper})")
    disjoint = "video_indices, audio_indices and text_indices must be unique and disjoint"
    if not eager:
        torch._assert_async(_unique_rows(rows), disjoint)
    # A host read-back (it drains the launch queue): memoized, so a layout reused across steps pays once.
    elif not memoized_over(rows, "disjoint_rows", lambda: bool(_unique_rows(rows))):
        raise ValueError(disjoint)
    if position_ids.dtype not in INDEX_DTYPES and not position_ids.is_floating_point():
        raise TypeError(f"position_ids must be an integer or float tensor, got {position_ids.dtype}")
    check_positions(position_ids, eager)
    return seq_len


def _unique_rows(indices: list[torch.Tensor]) -> torch.Tensor:
    # Sorted neighbours differ exactly when no row repeats: no data-dependent shape, so it also traces.
    ordered = torch.cat([i.to(torch.int64) for i in indices]).sort().values
    return (ordered[1:] != ordered[:-1]).all()
