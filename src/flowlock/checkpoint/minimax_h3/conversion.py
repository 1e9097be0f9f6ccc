"""What the directory-level machinery (``flowlock convert``, :func:`~flowlock.checkpoint.verify_directory`)
asks of the H3 family: the plan and output config of a conversion, and the tensor check of a result.

The generic streaming, atomic and manifest code calls only :func:`plan_directory` and
:func:`check_converted`; everything H3 knows (geometry, name table, q/k/v layouts, the native
``rope.inv_freq``) stays behind them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from flowlock.checkpoint.directory import Header, SafetensorsDirectory
from flowlock.checkpoint.errors import CheckpointError
from flowlock.checkpoint.minimax_h3.geometry import H3Geometry, diffusers_config, native_config, recorded_qkv_layout
from flowlock.checkpoint.minimax_h3.plan import Plan, Target, convert_entry, plan_conversion, source_kind
from flowlock.checkpoint.minimax_h3.qkv_layout import check_qkv_layout

# What ``flowlock convert --to native`` writes without --qkv-layout: the layout of the official native
# shards, the one vLLM-Omni's load_weights de-interleaves under native names.
DEFAULT_NATIVE_LAYOUT = "interleaved"


def resolve_qkv_layout(to: Target, given: str | None, source_config: Mapping[str, Any]) -> str:
    """The native q/k/v layout: ``given`` (or the default) when writing native; when reading native, the
    one the source records, which ``given`` must match, or ``given`` when it records none."""
    if given is not None:
        check_qkv_layout(given)
    if to == "native":
        return given or DEFAULT_NATIVE_LAYOUT
    recorded = recorded_qkv_layout(source_config)
    if recorded is None and given is None:
        raise CheckpointError("the source's q/k/v layout is not recorded and stacked and interleaved rows cannot be "
                              "told apart by shape: pass --qkv-layout stacked|interleaved")
    if recorded is not None and given is not None and recorded != given:
        raise CheckpointError(f"--qkv-layout {given} contradicts the source's recorded layout {recorded}")
    return given or recorded


def plan_directory(src: Path, config: Mapping[str, Any], headers: Mapping[str, Header],
                   load: Callable[[str], torch.Tensor], to: Target, qkv_layout: str | None) -> tuple[Plan, dict]:
    """The validated plan converting the directory ``src`` (its config and shard headers) ``to`` the other
    names, and the config.json of the result. Reads one tensor through ``load``: a native
    ``rope.inv_freq``, whose value is checked now so that it too fails before anything is written."""
    geometry = H3Geometry.from_config(config)
    if source_kind(headers, geometry) == to:
        raise CheckpointError(f"{src} already holds {to} names; nothing to convert")
    layout = resolve_qkv_layout(to, qkv_layout, config)
    plan = plan_conversion(headers, geometry, to, layout)
    for entry in plan.entries:
        if entry.kind == "rope":
            convert_entry(plan, entry, load)
    return plan, native_config(config, layout) if to == "native" else diffusers_config(config)


def check_converted(checkpoint: SafetensorsDirectory, kind: Target, qkv_layout: str | None) -> None:
    """Raise :class:`CheckpointError` unless ``checkpoint`` holds exactly the tensors of ``kind`` its config's
    name table gives, with their shapes, the FP32 set in float32, the q/k/v layout its config records
    equal to ``qkv_layout`` and, for native, the computed ``rope.inv_freq``."""
    native = kind == "native"
    if native and recorded_qkv_layout(checkpoint.config) != qkv_layout:
        raise CheckpointError(f"{checkpoint.path}: config.json records q/k/v layout "
                              f"{recorded_qkv_layout(checkpoint.config)!r}, the manifest {qkv_layout!r}")
    # Validating the directory as the source of the reverse conversion checks it holds exactly the
    # expected tensors of its kind, with their shapes and dtypes (the layout plays no part in
    # validating diffusers names, so any valid one does there).
    reverse = "diffusers" if native else "native"
    plan = plan_conversion(checkpoint.headers, H3Geometry.from_config(checkpoint.config), reverse,
                           qkv_layout or "stacked")
    for entry in plan.entries:
        if entry.kind == "rope" and reverse == "diffusers":
            convert_entry(plan, entry, checkpoint.load)
