"""H3's checkpoint geometry from a config, and the config.json each directory kind carries.

A diffusers directory's ``config.json`` is the ``MiniMaxH3Transformer3DModel`` config (diffusers
spellings). A native directory written by flowlock holds a ``config.json`` that vLLM-Omni's
``MiniMaxH3DiTModel`` reads directly: ``_class_name`` ``"MiniMaxH3DiTModel"`` (so the model's
auto-detection takes the tensors as native names), the ``MiniMaxH3DiTArchConfig`` field names,
the two AdaLN widths that class cannot derive for non-default sizes, ``rope_theta``, and a
``_flowlock`` record: the on-disk q/k/v layout and the diffusers config it came from, so the
reverse conversion gives that config back unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from flowlock.checkpoint.errors import CheckpointError

# diffusers config key -> MiniMaxH3DiTArchConfig field, for the keys whose spelling differs.
NATIVE_SPELLING = {
    "num_refiner_layers": "token_refiner_num_layers",
    "ffn_dim": "ffn_hidden_size",
    "in_channels": "latents_dim",
    "audio_in_channels": "audio_latents_dim",
    "freq_dim": "timestep_input_dim",
    "time_embed_hidden_dim": "time_embed_hidden_size",
    "rope_freq_dim": "rope_inv_freq_len",
}
_DIFFUSERS_SPELLING = {native: diffusers for diffusers, native in NATIVE_SPELLING.items()}
# Both engines default to this when the key is absent (diffusers' __init__, vLLM-Omni's loader).
DEFAULT_ROPE_THETA = 10000.0
_EPS_KEYS = ("norm_eps", "qk_norm_eps", "final_norm_eps")
NATIVE_CLASS = "MiniMaxH3DiTModel"
DIFFUSERS_CLASS = "MiniMaxH3Transformer3DModel"
FLOWLOCK_KEY = "_flowlock"


@dataclass(frozen=True)
class H3Geometry:
    """Every size the 638 diffusers / 535 native tensor shapes depend on (diffusers spellings)."""

    num_layers: int
    num_refiner_layers: int
    hidden_size: int
    num_attention_heads: int
    attention_head_dim: int
    ffn_dim: int
    in_channels: int
    patch_size: tuple[int, int, int]
    audio_in_channels: int
    text_dim: int
    freq_dim: int
    time_embed_hidden_dim: int
    time_embed_dim: int
    rope_freq_dim: int
    rope_theta: float = DEFAULT_ROPE_THETA

    @property
    def inner_dim(self) -> int:
        """Rows of each of to_q, to_k, to_v: heads x head_dim (no GQA in H3)."""
        return self.num_attention_heads * self.attention_head_dim

    @property
    def video_patch_dim(self) -> int:
        return self.in_channels * math.prod(self.patch_size)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> H3Geometry:
        """Read either spelling (diffusers or native field names); fail closed on a missing size, a key
        given in both spellings with different values, or native AdaLN widths that disagree."""
        values: dict[str, Any] = {}
        problems = []
        for key, value in config.items():
            name = _DIFFUSERS_SPELLING.get(key, key)
            if name in values and values[name] != value:
                problems.append(f"{key} = {value!r} disagrees with {name} = {values[name]!r}")
            values[name] = value
        wanted = [f.name for f in fields(cls) if f.name != "rope_theta"]
        missing = [name for name in wanted if name not in values]
        if missing:
            problems.append(f"missing keys: {', '.join(missing)}")
        if problems:
            raise CheckpointError("config does not describe an H3 transformer", problems)
        sizes = {name: values[name] for name in wanted if name != "patch_size"}
        patch = values["patch_size"]
        patch = list(patch) if isinstance(patch, (list, tuple)) else [patch]
        problems += _size_problems([*sizes.items(), *(("patch_size", p) for p in patch)])
        try:
            rope_theta = float(values.get("rope_theta", DEFAULT_ROPE_THETA))
        except (TypeError, ValueError):
            problems.append(f"rope_theta = {values['rope_theta']!r} is not a number")
        if len(patch) != 3:
            problems.append(f"patch_size must have 3 entries, got {values['patch_size']!r}")
        if problems:
            raise CheckpointError("config does not describe an H3 transformer", problems)
        geometry = cls(**sizes, patch_size=tuple(patch), rope_theta=rope_theta)
        for key, expected in (("adaln_out_features", 18 * geometry.hidden_size),
                              ("final_adaln_out_features", 2 * geometry.hidden_size)):
            if key in config and config[key] != expected:
                problems.append(f"{key} = {config[key]} but 18/2 x hidden_size gives {expected}")
        if problems:
            raise CheckpointError("config does not describe an H3 transformer", problems)
        return geometry

    def diffusers_config(self) -> dict[str, Any]:
        """A ``MiniMaxH3Transformer3DModel`` config for this geometry (eps keys left to their defaults)."""
        config: dict[str, Any] = {"_class_name": DIFFUSERS_CLASS}
        for f in fields(self):
            value = getattr(self, f.name)
            config[f.name] = list(value) if f.name == "patch_size" else value
        return config


def _size_problems(sizes: list[tuple[str, Any]]) -> list[str]:
    problems = []
    for name, value in sizes:
        layers = name in ("num_layers", "num_refiner_layers")  # a model may have none; widths may not be 0
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if layers else 1):
            problems.append(f"{name} = {value!r} is not a {'non-negative' if layers else 'positive'} integer")
    return problems


def native_config(diffusers_config: Mapping[str, Any], qkv_layout: str) -> dict[str, Any]:
    """The native directory's config.json for a diffusers config (see the module docstring)."""
    geometry = H3Geometry.from_config(diffusers_config)
    config: dict[str, Any] = {"_class_name": NATIVE_CLASS}
    for key, value in geometry.diffusers_config().items():
        if key != "_class_name":
            config[NATIVE_SPELLING.get(key, key)] = value
    for key in _EPS_KEYS:
        if key in diffusers_config:
            config[key] = diffusers_config[key]
    config["adaln_out_features"] = 18 * geometry.hidden_size
    config["final_adaln_out_features"] = 2 * geometry.hidden_size
    config[FLOWLOCK_KEY] = {"qkv_layout": qkv_layout, "diffusers_config": dict(diffusers_config)}
    return config


def diffusers_config(native: Mapping[str, Any]) -> dict[str, Any]:
    """The diffusers config.json for a native config: the recorded original when flowlock wrote the
    native directory (checked against the native sizes), else one rebuilt from the sizes."""
    geometry = H3Geometry.from_config(native)
    record = native.get(FLOWLOCK_KEY, {}).get("diffusers_config")
    if record is None:
        config = geometry.diffusers_config()
        for key in _EPS_KEYS:
            if key in native:
                config[key] = native[key]
        return config
    if H3Geometry.from_config(record) != geometry:
        raise CheckpointError("the diffusers config recorded in the native config.json disagrees with its sizes",
                              [f"recorded {H3Geometry.from_config(record)}", f"native {geometry}"])
    return dict(record)


def recorded_qkv_layout(native: Mapping[str, Any]) -> str | None:
    """The q/k/v layout a flowlock-written native config.json records, or None for other sources."""
    return native.get(FLOWLOCK_KEY, {}).get("qkv_layout")
