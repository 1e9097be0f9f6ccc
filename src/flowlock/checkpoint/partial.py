"""The hidden directory a conversion writes into before publishing, and the sweep of stale ones.

A conversion into DST writes ``.DST.<16 hex digits>.partial`` next to DST and holds an exclusive
``flock`` on that directory from its creation until it is renamed onto DST or removed. The kernel
drops the lock when the process ends however it ends (SIGKILL included), so a partial directory
whose lock can be taken belongs to no live conversion: :func:`sweep_partials` removes those and
keeps the held ones. A lock rather than a pid file: a reused pid cannot make a dead conversion look
alive, and a sweep needs nothing from the holder. (On NFS, Linux emulates flock with byte-range
locks, which also end with the process.)
"""

from __future__ import annotations

import fcntl
import os
import re
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path

from flowlock.checkpoint.errors import CheckpointError

SUFFIX = ".partial"
_ATTEMPTS = 16


def _pattern(dst: Path) -> re.Pattern[str]:
    # The random part has no dot, so DST "a" never claims the partials of a DST named "a.b".
    return re.compile(rf"\.{re.escape(dst.name)}\.[0-9a-f]{{16}}{re.escape(SUFFIX)}")


def partial_dirs(dst: Path) -> list[Path]:
    """The partial directories of conversions into ``dst`` (real directories only, never symlinks)."""
    pattern = _pattern(dst)
    return sorted(p for p in dst.parent.iterdir() if pattern.fullmatch(p.name) and p.is_dir() and not p.is_symlink())


def _open_locked(path: Path, blocking: bool) -> int | None:
    """A read-only descriptor of the directory ``path`` holding its exclusive flock, or None when another
    process holds it (only when not ``blocking``)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if blocking else fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


class PartialDirectory:
    """A new, empty, owner-only partial directory next to ``dst``, locked until :meth:`release`."""

    def __init__(self, dst: Path) -> None:
        for _ in range(_ATTEMPTS):
            path = dst.parent / f".{dst.name}.{secrets.token_hex(8)}{SUFFIX}"
            try:
                os.mkdir(path, 0o700)
            except FileExistsError:
                continue
            # Between the mkdir and this lock a sweep may take the directory for a stale one and remove
            # it: then the open fails, or the lock (blocking: a sweep holds it only while removing)
            # comes on a removed directory, which the identity check sees; either way, a new name.
            try:
                fd = _open_locked(path, blocking=True)
            except FileNotFoundError:
                continue
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(path))
            except FileNotFoundError:
                same = False
            if same:
                self.path, self._fd = path, fd
                return
            os.close(fd)
        raise CheckpointError(f"could not create a partial directory next to {dst} in {_ATTEMPTS} attempts")

    def release(self) -> None:
        """Drop the lock (after the directory was renamed onto DST or removed)."""
        os.close(self._fd)


@dataclass(frozen=True)
class Sweep:
    """What :func:`sweep_partials` did: partial directories ``removed`` (no live holder) and ``held``
    (a live conversion holds them, so they were kept)."""

    removed: tuple[Path, ...]
    held: tuple[Path, ...]


def sweep_partials(dst: str | Path) -> Sweep:
    """Remove every partial directory of conversions into ``dst`` that no live process holds.

    Each one is locked before it is removed, so a conversion starting meanwhile or a second sweep
    never loses a directory it holds. Raises :class:`CheckpointError` when DST's parent is not a
    directory, ``OSError`` when a stale directory cannot be removed.
    """
    dst = Path(dst)
    if not dst.parent.is_dir():
        raise CheckpointError(f"{dst.parent} (the parent of DST) is not a directory")
    removed, held = [], []
    for path in partial_dirs(dst):
        try:
            fd = _open_locked(path, blocking=False)
        except FileNotFoundError:  # a concurrent sweep removed it first
            continue
        if fd is None:
            held.append(path)
            continue
        try:
            shutil.rmtree(path)
        finally:
            os.close(fd)
        removed.append(path)
    return Sweep(tuple(removed), tuple(held))
