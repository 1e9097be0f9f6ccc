"""In-memory diffusers <-> vLLM-Omni native state dicts of H3.

``diffusers_to_native(model.state_dict(), model.config, qkv_layout="stacked")`` is what
``MiniMaxH3DiTModel.load_state_dict(..., strict=True)`` takes (the class holds q/k/v stacked);
``qkv_layout="interleaved"`` gives the official on-disk layout that its ``load_weights`` reads under
native names. Dtypes are kept as given (FP32 set float32, checked); renamed tensors are the input
tensors themselves, fused, split and swapped ones are new.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from flowlock.checkpoint.directory import Header
from flowlock.checkpoint.errors import CheckpointError
from flowlock.checkpoint.minimax_h3.geometry import H3Geometry
from flowlock.checkpoint.minimax_h3.plan import Target, convert_entry, plan_conversion

Weights = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def _collect(weights: Weights) -> dict[str, torch.Tensor]:
    """A name -> tensor dict; an iterable of pairs that names a tensor twice is refused."""
    pairs = weights.items() if isinstance(weights, Mapping) else weights
    tensors: dict[str, torch.Tensor] = {}
    duplicates = set()
    for name, tensor in pairs:
        if name in tensors:
            duplicates.add(name)
        tensors[name] = tensor
    if duplicates:
        raise CheckpointError("duplicate tensor names", [", ".join(sorted(duplicates))])
    return tensors


def _geometry(config: Mapping[str, Any] | H3Geometry) -> H3Geometry:
    return config if isinstance(config, H3Geometry) else H3Geometry.from_config(config)


def convert_state_dict(weights: Weights, config: Mapping[str, Any] | H3Geometry, *, to: Target,
                       qkv_layout: str) -> dict[str, torch.Tensor]:
    """Convert a whole state dict ``to`` ``"native"`` or ``"diffusers"`` names; see the module docstring.

    ``qkv_layout`` (``"stacked"`` or ``"interleaved"``) is the layout of the native ``qkv_proj``
    tensors: the one to write going to native, the one the input holds going to diffusers.
    Raises :class:`CheckpointError` before converting anything if a name is unknown, missing or
    duplicated, a q/k/v group is incomplete or mismatched, or a shape or dtype is wrong.
    """
    tensors = _collect(weights)
    headers = {name: Header(tuple(t.shape), t.dtype) for name, t in tensors.items()}
    plan = plan_conversion(headers, _geometry(config), to, qkv_layout)
    out: dict[str, torch.Tensor] = {}
    for entry in plan.entries:
        out.update(convert_entry(plan, entry, tensors.__getitem__))
    return out


def diffusers_to_native(weights: Weights, config: Mapping[str, Any] | H3Geometry, *,
                        qkv_layout: str) -> dict[str, torch.Tensor]:
    """638 diffusers tensors (H3 sizes) -> 535 native ones, ``rope.inv_freq`` computed from the config."""
    return convert_state_dict(weights, config, to="native", qkv_layout=qkv_layout)


def native_to_diffusers(weights: Weights, config: Mapping[str, Any] | H3Geometry, *,
                        qkv_layout: str) -> dict[str, torch.Tensor]:
    """535 native tensors -> 638 diffusers ones; ``rope.inv_freq`` must equal the computed one and is dropped."""
    return convert_state_dict(weights, config, to="diffusers", qkv_layout=qkv_layout)
