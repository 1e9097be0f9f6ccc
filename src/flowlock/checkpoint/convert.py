"""``flowlock convert``: a diffusers H3 directory to a native one or back, streamed and atomic.

This module is the family-independent part: reading, packing, writing and publishing. What the
tensors are and how they map comes from the model family's plan
(:func:`~flowlock.checkpoint.minimax_h3.conversion.plan_directory` for H3).

Guarantees of :func:`convert_directory`:

* fail closed before writing: the source's config, index and shard headers are checked in full
  (names, shapes, dtypes, q/k/v groups, duplicates, the q/k/v layout, a native ``rope.inv_freq``)
  and every defect is raised as one :class:`CheckpointError`;
* finite values: each tensor is checked for NaN and Inf as it is read (no second read); one that
  holds any stops the writing, the reading goes on to find every such tensor, and all are raised as
  one :class:`CheckpointError` (name, shard, counts) before DST exists. ``allow_nonfinite`` copies
  them as they are and lists them in the report;
* bounded memory: entries are taken in the order of the input shard holding their first source
  (a q/k/v group split across shards is read whole, its other parts fetched from their shards)
  and packed into output shards no larger than the largest input shard; tensors are read one at a
  time and a shard's tensors are released once it is written, so at most one shard plus the q/k/v
  group being fused or split is alive, whatever order the source stores its tensors in;
* atomic: everything is written into a hidden ``.DST.<hex>.partial`` directory next to DST, locked
  for the conversion's life (:mod:`flowlock.checkpoint.partial`), and renamed onto DST at the very
  end; any failure (an exception, Ctrl-C) removes it, and a killed process leaves at most that
  directory, never DST. The next conversion into DST (or ``flowlock convert --clean DST``) removes
  such leftovers once the source has passed the checks above, and keeps those a live conversion holds;
* DST holds the shards, an index (always, even for one shard), config.json and the SHA-256
  manifest; ``verify`` re-reads all of it (:func:`~flowlock.checkpoint.manifest.verify_directory`)
  before the rename, so a directory that fails verification is never published.

Native directories use the transformers/vLLM names ``model-0000i-of-0000n.safetensors`` and
``model.safetensors.index.json``; diffusers ones ``diffusion_pytorch_model-…`` as ``save_pretrained``
does. Files of SRC other than config, index and shards are not carried.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from flowlock.checkpoint.directory import CONFIG, SafetensorsDirectory, header_bytes
from flowlock.checkpoint.errors import CheckpointError
from flowlock.checkpoint.finite import FiniteLoader
from flowlock.checkpoint.manifest import verify_directory, write_manifest
from flowlock.checkpoint.minimax_h3.conversion import plan_directory
from flowlock.checkpoint.minimax_h3.names import Entry
from flowlock.checkpoint.minimax_h3.plan import Plan, Target, convert_entry
from flowlock.checkpoint.partial import PartialDirectory, Sweep, sweep_partials

_PREFIX = {"native": "model", "diffusers": "diffusion_pytorch_model"}

WriteShard = Callable[[dict[str, torch.Tensor], Path], None]


def save_shard(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Write one output shard (the default :data:`WriteShard`); tensors must be contiguous and unshared."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})


@dataclass(frozen=True)
class ConversionReport:
    """What :func:`convert_directory` published: ``tensors`` in ``shards`` files, ``bytes`` of tensor data;
    ``nonfinite``: the source tensors copied with NaN or Inf in them (only with ``allow_nonfinite``);
    ``swept``: the stale partial directories of earlier conversions into DST removed, and those kept."""

    dst: Path
    to: Target
    qkv_layout: str
    shards: int
    tensors: int
    bytes: int
    verified: bool
    nonfinite: tuple[str, ...]
    swept: Sweep


def _shard_plan(plan: Plan, source: SafetensorsDirectory) -> list[list[Entry]]:
    """Entries per output shard: taken in the order of the input shard holding their first source, packed
    greedily up to the largest input shard's bytes (a shard with no output is dropped)."""
    position = {name: i for i, name in enumerate(source.files)}
    limit = max(source.shard_bytes(f) for f in source.files)
    lead = {e.native: min((position[source.file_of[n]] for n in plan.sources(e)), default=0) for e in plan.entries}
    shards: list[list[Entry]] = [[]]
    size = 0
    for entry in sorted(plan.entries, key=lambda e: lead[e.native]):
        nbytes = sum(header_bytes(source.headers[n]) for n in plan.sources(entry))  # = its outputs' bytes
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    return [entries for entries in shards if any(plan.targets(e) for e in entries)]


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    # disable=None: tqdm stays silent when stderr is not a terminal.
    return tqdm(total=total, unit="tensor", desc="flowlock convert", disable=None if enabled else True)


def convert_directory(src: str | Path, dst: str | Path, *, to: Target, qkv_layout: str | None = None,
                      verify: bool = False, progress: bool = False, allow_nonfinite: bool = False,
                      open_source: Callable[[Path], SafetensorsDirectory] = SafetensorsDirectory,
                      write_shard: WriteShard = save_shard) -> ConversionReport:
    """Convert the checkpoint directory ``src`` to ``to`` names into the new directory ``dst``.

    ``qkv_layout`` is the native q/k/v layout (see
    :func:`~flowlock.checkpoint.minimax_h3.conversion.resolve_qkv_layout`). ``open_source`` and
    ``write_shard`` are the reading and writing seams (tests count live tensors and inject crashes
    through them). Guarantees: the module docstring. Raises :class:`CheckpointError` on any input
    that cannot be converted exactly, on NaN or Inf in a tensor (unless ``allow_nonfinite``) and when
    ``dst`` exists.
    """
    dst = Path(dst)
    if dst.exists():
        raise CheckpointError(f"{dst} exists: flowlock convert writes a new directory and never overwrites")
    if not dst.parent.is_dir():
        raise CheckpointError(f"{dst.parent} (the parent of DST) is not a directory")
    source = open_source(Path(src))
    try:
        plan, config = plan_directory(Path(src), source.config, source.headers, source.load, to, qkv_layout)
        shards = _shard_plan(plan, source)
        swept = sweep_partials(dst)
        return _write(plan, source, shards, config, dst, verify, progress, allow_nonfinite, write_shard, swept)
    finally:
        source.close()


def _write(plan: Plan, source: SafetensorsDirectory, shards: list[list[Entry]], config: dict, dst: Path,
           verify: bool, progress: bool, allow_nonfinite: bool, write_shard: WriteShard,
           swept: Sweep) -> ConversionReport:
    prefix = _PREFIX[plan.to]
    reader = FiniteLoader(source)
    partial = PartialDirectory(dst)
    tmp = partial.path
    bar = _progress(sum(len(plan.targets(e)) for e in plan.entries), progress)
    try:
        weight_map: dict[str, str] = {}
        total = 0
        for i, entries in enumerate(shards):
            name = f"{prefix}-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            tensors: dict[str, torch.Tensor] = {}  # rebinding releases the previous shard before any read
            for entry in entries:
                tensors.update(convert_entry(plan, entry, reader.load))
                bar.update(len(plan.targets(entry)))
            if reader.findings and not allow_nonfinite:
                continue  # DST will not be published: only read on, to name every such tensor
            write_shard(tensors, tmp / name)
            weight_map.update(dict.fromkeys(tensors, name))
            total += sum(t.numel() * t.element_size() for t in tensors.values())
        if reader.findings and not allow_nonfinite:
            raise CheckpointError(f"{source.path} holds NaN or Inf values; nothing was written (pass "
                                  "--allow-nonfinite, allow_nonfinite=True, to copy them as they are)",
                                  reader.findings)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / f"{prefix}.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        write_manifest(tmp, plan.to, plan.qkv_layout if plan.to == "native" else None)
        if verify:
            verify_directory(tmp)
        _publishable(tmp)
        if dst.exists():
            raise CheckpointError(f"{dst} appeared while converting; the result was not published")
        os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        partial.release()
        bar.close()
    _fsync_dir(dst.parent)
    return ConversionReport(dst, plan.to, plan.qkv_layout, len(shards), len(weight_map), total, verify,
                            tuple(reader.findings), swept)


def _publishable(tmp: Path) -> None:
    """Ordinary permissions (umask applied): the partial directory is owner-only, and DST is meant to be shared."""
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)
    for path in tmp.iterdir():
        path.chmod(0o666 & ~umask)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
