"""Checkpoints for the mapper and converter tests: the tiny diffusers H3 and one with all 638 names.

``FULL_NAMES_CONFIG`` keeps H3's 50 blocks and 2 refiner blocks (so every one of the 638 diffusers
names exists) at widths small enough to build and convert in well under a second.
"""

from __future__ import annotations

from pathlib import Path

import torch

FULL_NAMES_CONFIG = dict(num_attention_heads=2, attention_head_dim=8, hidden_size=16, num_layers=50,
                         num_refiner_layers=2, ffn_dim=12, in_channels=2, audio_in_channels=4, patch_size=(1, 2, 2),
                         text_dim=8, freq_dim=8, time_embed_hidden_dim=16, time_embed_dim=8, rope_freq_dim=1)


def config_of(model) -> dict:
    """The model's config as save_pretrained writes it, less diffusers' private keys."""
    return {k: v for k, v in dict(model.config).items() if not k.startswith("_")}


def state_dict_of(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def save_diffusers(model, path: Path, max_shard_size: str | None = None) -> Path:
    """``save_pretrained`` into ``path``, sharded when ``max_shard_size`` is given."""
    model.save_pretrained(str(path), **({} if max_shard_size is None else {"max_shard_size": max_shard_size}))
    return path
