"""The models and inputs every rank program of ``flowlock check --layout`` / ``trace --layout`` shares (tiny H3)."""

from __future__ import annotations

import torch
from diffusers import ContextParallelConfig

from flowlock.models.minimax_h3 import TINY_H3_CONFIG, build_packing, make_h3, packing_for_length, tiny_h3, tiny_inputs

LATENTS = ("hidden_states", "audio_hidden_states", "encoder_hidden_states")
BATCH = 2
FOUR_HEADS = dict(TINY_H3_CONFIG, num_attention_heads=4)
# The packed rows of the suites' samples: S = 24 (a multiple of 2 and 4), 25 (of neither), 3 (fewer
# rows than 4 ranks: a zero-row shard).
PACKINGS = (build_packing(5, 2, 2, 3, 7), build_packing(5, 2, 2, 3, 8), build_packing(1, 1, 1, 1, 1))


def traced_batch(seq_len: int) -> dict:
    """The batch ``trace --layout`` runs: ``BATCH`` samples of one packing of ``seq_len`` rows
    (:data:`PACKINGS`' for their lengths, ``packing_for_length``'s for others)."""
    known = {packing.seq_len: packing for packing in PACKINGS}
    return tiny_inputs(BATCH, seed=1, packing=known.get(seq_len) or packing_for_length(seq_len))


def model_for(degree: int):
    """The tiny H3 (2 heads) for degree <= 2, the same with 4 heads for degree 4."""
    return tiny_h3() if degree <= 2 else make_h3(FOUR_HEADS)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (FSDP2 gradients are DTensors)."""
    return t.to_local() if hasattr(t, "to_local") else t


def cp_model(degree: int, base=None, **config):
    """``base`` (default: :func:`model_for`) under diffusers' ``enable_parallelism`` with Ulysses ``degree``."""
    model = base if base is not None else model_for(degree)
    model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=degree, **config))
    return model
