"""Checkpoints for the mapper and converter tests: the tiny diffusers H3 and one with all 638 names.

``FULL_NAMES_CONFIG`` keeps H3's 50 blocks and 2 refiner blocks (so every one of the 638 diffusers
names exists) at widths small enough to build and convert in well under a second.
"""

from __future__ import annotations

import json
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


def write_checkpoint(path: Path, shards: list[dict[str, torch.Tensor]], config: dict, *, index: bool = True,
                     prefix: str = "diffusion_pytorch_model") -> Path:
    """A checkpoint directory written by hand (shards in this order), to build the defects save_pretrained won't."""
    from safetensors.torch import save_file

    path.mkdir()
    weight_map = {}
    for i, tensors in enumerate(shards):
        name = f"{prefix}-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(path / name))
        weight_map.update(dict.fromkeys(tensors, name))
    if index:
        (path / f"{prefix}.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(config))
    return path


def read_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """Every tensor of every shard of a directory, and its config."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    return tensors, json.loads((path / "config.json").read_text())


def split_evenly(tensors: dict[str, torch.Tensor], n: int) -> list[dict[str, torch.Tensor]]:
    names = list(tensors)
    size = -(-len(names) // n)
    return [{k: tensors[k] for k in names[i:i + size]} for i in range(0, len(names), size)]
