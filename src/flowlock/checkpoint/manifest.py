"""The SHA-256 manifest of a converted directory, and the check that re-reads it.

``flowlock_manifest.json`` lists every other file of the directory with its SHA-256 and size, plus
the directory's kind (``native`` or ``diffusers``) and native q/k/v layout. :func:`verify_directory`
re-hashes every file and re-reads the directory as a checkpoint: the index and shard headers must
agree, and the model family checks the tensors (for H3,
:func:`~flowlock.checkpoint.minimax_h3.conversion.check_converted`).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from flowlock.checkpoint.directory import SafetensorsDirectory, read_json
from flowlock.checkpoint.errors import CheckpointError
from flowlock.checkpoint.minimax_h3.conversion import check_converted

MANIFEST = "flowlock_manifest.json"
FORMAT = "flowlock-checkpoint-manifest/1"
_CHUNK = 16 * 1024 * 1024


def sha256_file(path: Path) -> str:
    """SHA-256 of ``path``, read in 16 MiB chunks; the file is fsynced (it is about to be published)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            digest.update(block)
        os.fsync(f.fileno())
    return digest.hexdigest()


def _files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name != MANIFEST)


def write_manifest(directory: Path, kind: str, qkv_layout: str | None) -> dict[str, Any]:
    """Hash every file of ``directory`` into its manifest; returns the manifest written. ``qkv_layout``
    is the native directory's q/k/v layout (None for a diffusers directory, which has no fused q/k/v)."""
    manifest = {"format": FORMAT, "kind": kind, "qkv_layout": qkv_layout,
                "files": {name: {"sha256": sha256_file(directory / name), "bytes": (directory / name).stat().st_size}
                          for name in _files(directory)}}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest


def verify_directory(directory: str | Path) -> dict[str, Any]:
    """Check ``directory`` against its manifest (see the module docstring); raises :class:`CheckpointError`
    naming every file or tensor that does not match, else returns the manifest."""
    directory = Path(directory)
    if not (directory / MANIFEST).is_file():
        raise CheckpointError(f"{directory} has no {MANIFEST}")
    manifest = read_json(directory / MANIFEST)
    if manifest.get("format") != FORMAT or manifest.get("kind") not in ("native", "diffusers"):
        raise CheckpointError(f"{directory / MANIFEST} is not a {FORMAT} manifest")
    listed, present = set(manifest["files"]), set(_files(directory))
    problems = [f"{name}: listed in the manifest, not on disk" for name in sorted(listed - present)]
    problems += [f"{name}: on disk, not in the manifest" for name in sorted(present - listed)]
    problems += [f"{name}: SHA-256 differs from the manifest" for name in sorted(listed & present)
                 if sha256_file(directory / name) != manifest["files"][name]["sha256"]]
    if problems:
        raise CheckpointError(f"{directory} does not match its manifest", problems)
    checkpoint = SafetensorsDirectory(directory)
    try:
        check_converted(checkpoint, manifest["kind"], manifest["qkv_layout"])
    finally:
        checkpoint.close()
    return manifest
