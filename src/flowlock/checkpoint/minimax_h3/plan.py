"""Validate a checkpoint's names, shapes and dtypes against the name table, then convert entry by entry.

:func:`plan_conversion` needs only each tensor's shape and dtype (a safetensors header), so every
defect it can see is reported, all at once, before any tensor is read or anything written.
:func:`convert_entry` then turns the source tensors of one entry into its targets; it reads only
those tensors, which is what lets a directory be converted one shard and one q/k/v group at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from flowlock.checkpoint.directory import Header
from flowlock.checkpoint.errors import CheckpointError
from flowlock.checkpoint.minimax_h3.geometry import H3Geometry
from flowlock.checkpoint.minimax_h3.names import Entry, name_table
from flowlock.checkpoint.minimax_h3.qkv_layout import check_qkv_layout, fuse_qkv, rope_inv_freq, split_qkv, swap_halves

Target = Literal["native", "diffusers"]
_LISTED = 12  # names shown per finding; the count is always given


@dataclass(frozen=True)
class Plan:
    """A validated conversion: ``entries`` in output order, every source present with the right shape."""

    to: Target
    geometry: H3Geometry
    qkv_layout: str
    entries: tuple[Entry, ...]

    def sources(self, entry: Entry) -> tuple[str, ...]:
        return entry.diffusers if self.to == "native" else (entry.native,)

    def targets(self, entry: Entry) -> tuple[str, ...]:
        return (entry.native,) if self.to == "native" else entry.diffusers


def _names(names: Iterable[str]) -> str:
    names = sorted(names)
    shown = ", ".join(names[:_LISTED])
    return f"{len(names)}: {shown}" + (f", ... and {len(names) - _LISTED} more" if len(names) > _LISTED else "")


def _source_side(entries: tuple[Entry, ...], to: Target) -> dict[str, tuple[tuple[int, ...], bool]]:
    """Name -> (shape, in the FP32 set) of every tensor a conversion ``to`` reads."""
    if to == "native":
        return {name: (shape, e.fp32) for e in entries for name, shape in zip(e.diffusers, e.diffusers_shapes)}
    return {e.native: (e.native_shape, e.fp32) for e in entries}


def source_kind(names: Iterable[str], geometry: H3Geometry) -> Target | None:
    """Which side's names ``names`` mostly are (``None`` when neither): to refuse converting a
    directory into the layout it already has with that reason rather than a list of unknown names."""
    entries = name_table(geometry)
    names = set(names)
    hits = {"diffusers": len(names & set(_source_side(entries, "native"))),
            "native": len(names & set(_source_side(entries, "diffusers")))}
    if hits["native"] == hits["diffusers"]:
        return None
    return max(hits, key=hits.get)


def plan_conversion(headers: Mapping[str, Header], geometry: H3Geometry, to: Target, qkv_layout: str) -> Plan:
    """Check ``headers`` (the source side of a conversion ``to`` the other side) and return its plan.

    Raises :class:`CheckpointError` listing every unknown, missing, wrong-shape and wrong-dtype tensor,
    every incomplete q/k/v group and every group whose q, k, v dtypes differ. FP32-set tensors must be
    float32 (the mapper never casts, so they stay FP32); the rest must be floating point.
    """
    if to not in ("native", "diffusers"):
        raise CheckpointError(f"conversion target must be 'native' or 'diffusers'; got {to!r}")
    check_qkv_layout(qkv_layout)
    plan = Plan(to, geometry, qkv_layout, name_table(geometry))
    expected = _source_side(plan.entries, to)
    problems = _name_problems(plan, headers, expected) + _header_problems(headers, expected)
    if problems:
        raise CheckpointError(f"cannot convert this checkpoint to {to} names", problems)
    return plan


def _name_problems(plan: Plan, headers: Mapping[str, Header], expected: Mapping[str, object]) -> list[str]:
    problems = []
    unknown = set(headers) - set(expected)
    if unknown:
        problems.append(f"unknown tensors {_names(unknown)}")
        other = unknown & set(_source_side(plan.entries, "diffusers" if plan.to == "native" else "native"))
        if other:
            problems.append(f"{len(other)} of them are {plan.to} names: the source already is in the {plan.to} layout")
    missing, incomplete, mixed = [], [], []
    for entry in plan.entries:
        names = plan.sources(entry)
        present = [n for n in names if n in headers]
        if entry.kind == "qkv" and plan.to == "native" and 0 < len(present) < 3:
            absent = [n.rsplit(".", 2)[-2] for n in names if n not in headers]
            incomplete.append(f"{entry.native} (has {', '.join(present)}; lacks {', '.join(absent)})")
        else:
            missing.extend(n for n in names if n not in headers)
        if entry.kind == "qkv" and len(present) == 3 and len({headers[n].dtype for n in present}) > 1:
            mixed.append(f"{entry.native} ({', '.join(f'{n}: {headers[n].dtype}' for n in present)})")
    if missing:
        problems.append(f"missing tensors {_names(missing)}")
    problems.extend(f"incomplete q/k/v group {g}" for g in incomplete)
    problems.extend(f"q/k/v dtypes differ in {g}" for g in mixed)
    return problems


def _header_problems(headers: Mapping[str, Header], expected: Mapping[str, tuple[tuple[int, ...], bool]]) -> list[str]:
    problems = []
    for name in sorted(set(headers) & set(expected)):
        shape, fp32 = expected[name]
        header = headers[name]
        if header.shape != shape:
            problems.append(f"{name}: shape {list(header.shape)}, the config gives {list(shape)}")
        if fp32 and header.dtype != torch.float32:
            problems.append(f"{name}: {header.dtype}, but it is in the FP32 set and must be stored as torch.float32")
        elif not header.dtype.is_floating_point:
            problems.append(f"{name}: {header.dtype} is not a floating-point dtype")
    return problems


def convert_entry(plan: Plan, entry: Entry, load: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
    """The target tensors of ``entry``, reading its sources through ``load`` (name -> tensor).

    Renames return the loaded tensor itself (no copy); fc1 and q/k/v return new tensors. Going to
    diffusers, ``rope.inv_freq`` produces nothing: diffusers recomputes it, so it must equal
    :func:`~flowlock.checkpoint.minimax_h3.qkv_layout.rope_inv_freq` bit for bit or the round trip would change it.
    """
    head_dim = plan.geometry.attention_head_dim
    if entry.kind == "rope":
        computed = rope_inv_freq(plan.geometry.rope_freq_dim, plan.geometry.rope_theta)
        if plan.to == "native":
            return {entry.native: computed}
        stored = load(entry.native)
        if not torch.equal(stored.view(torch.int32), computed.view(torch.int32)):
            raise CheckpointError(f"{entry.native} is not the one diffusers computes from rope_theta = "
                                  f"{plan.geometry.rope_theta}: converting would drop its stored bits",
                                  [f"stored {stored.tolist()}", f"computed {computed.tolist()}"])
        return {}
    if plan.to == "native":
        parts = [load(name) for name in entry.diffusers]
        if entry.kind == "qkv":
            return {entry.native: fuse_qkv(*parts, plan.qkv_layout, head_dim)}
        return {entry.native: swap_halves(parts[0]) if entry.kind == "fc1" else parts[0]}
    tensor = load(entry.native)
    if entry.kind == "qkv":
        return dict(zip(entry.diffusers, split_qkv(tensor, plan.qkv_layout, head_dim)))
    return {entry.diffusers[0]: swap_halves(tensor) if entry.kind == "fc1" else tensor}
