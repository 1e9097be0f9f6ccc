"""A checkpoint directory of safetensors shards, read header first and one tensor at a time.

A directory holds ``config.json`` and either one ``*.safetensors.index.json`` (whose weight map
names the shards) or, without an index, every ``*.safetensors`` file in it. Opening one reads only
the config, the index and the shards' JSON headers, and refuses (naming the files and tensors) an
index that names a tensor twice, a missing shard, a tensor in two shards, or an index and shard
headers that disagree. :meth:`SafetensorsDirectory.load` then reads single tensors.
"""

from __future__ import annotations

import json
import math
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flowlock.checkpoint.errors import CheckpointError

CONFIG = "config.json"
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit on the JSON header
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


@dataclass(frozen=True)
class Header:
    """What a checkpoint says about one tensor before it is read."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _unique_keys(path: Path):
    """A json ``object_pairs_hook`` that refuses repeated keys (json.loads would keep the last)."""

    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        repeated = sorted(key for key, count in Counter(key for key, _ in pairs).items() if count > 1)
        if repeated:
            raise CheckpointError(f"{path.name} names the same key twice", [", ".join(repeated)])
        return dict(pairs)

    return hook


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=_unique_keys(path))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"cannot read {path}: {err}") from err


def read_header(path: Path) -> dict[str, Header]:
    """Name -> shape and dtype from a safetensors file's header, without reading any tensor.

    The byte ranges are checked too (each tensor's range holds exactly its shape's bytes and the
    ranges end where the file does), so a truncated or padded shard is refused before conversion.
    """
    try:
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > _MAX_HEADER:
                raise CheckpointError(f"{path.name}: safetensors header of {size} bytes is not plausible")
            raw = json.loads(f.read(size), object_pairs_hook=_unique_keys(path))
        raw.pop("__metadata__", None)
        unknown = sorted({info["dtype"] for info in raw.values()} - set(_DTYPES))
        if unknown:
            raise CheckpointError(f"{path.name} holds dtypes flowlock does not read: {', '.join(unknown)}")
        headers = {name: Header(tuple(info["shape"]), _DTYPES[info["dtype"]]) for name, info in raw.items()}
        spans = {name: tuple(info["data_offsets"]) for name, info in raw.items()}
    except (OSError, struct.error, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as err:
        raise CheckpointError(f"{path.name} is not a readable safetensors file: {err}") from err
    data = path.stat().st_size - 8 - size
    wrong = [f"{name}: bytes {start}..{end} for {list(headers[name].shape)} {headers[name].dtype}"
             for name, (start, end) in spans.items() if end - start != header_bytes(headers[name])]
    if wrong or max((end for _, end in spans.values()), default=0) != data:
        raise CheckpointError(f"{path.name}: tensor byte ranges do not match the header or the file's "
                              f"{data} data bytes (truncated?)", wrong)
    return headers


class SafetensorsDirectory:
    """The tensors of one checkpoint directory (see the module docstring).

    ``files``: shard names in order (index order of first appearance, else sorted); ``headers``:
    name -> :class:`Header`; ``file_of``: name -> shard; ``config``: the parsed config.json.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path} is not a directory")
        if not (self.path / CONFIG).is_file():
            raise CheckpointError(f"{self.path} has no {CONFIG}: the layout sizes come from it")
        self.config = read_json(self.path / CONFIG)
        self.files, indexed = self._shard_files()
        self.headers: dict[str, Header] = {}
        self.file_of: dict[str, str] = {}
        in_two = []
        for name in self.files:
            for tensor, header in read_header(self.path / name).items():
                if tensor in self.file_of:
                    in_two.append(f"{tensor} ({self.file_of[tensor]} and {name})")
                self.headers[tensor] = header
                self.file_of[tensor] = name
        if in_two:
            raise CheckpointError(f"{self.path}: duplicate tensors, each stored in two shards", in_two)
        if indexed is not None:
            self._check_index(indexed)
        self._handles: dict[str, Any] = {}

    def _shard_files(self) -> tuple[list[str], dict[str, str] | None]:
        indexes = sorted(p.name for p in self.path.glob("*.safetensors.index.json"))
        if len(indexes) > 1:
            raise CheckpointError(f"{self.path} holds more than one index: {', '.join(indexes)}")
        if not indexes:
            files = sorted(p.name for p in self.path.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{self.path} holds no *.safetensors file")
            return files, None
        weight_map = read_json(self.path / indexes[0]).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{indexes[0]} has no weight_map")
        files = list(dict.fromkeys(weight_map.values()))
        absent = [f for f in files if not (self.path / f).is_file()]
        if absent:
            raise CheckpointError(f"{indexes[0]} names shards that are not in {self.path}", absent)
        return files, weight_map

    def _check_index(self, weight_map: dict[str, str]) -> None:
        problems = [f"{name}: index says {file}, found in {self.file_of.get(name, 'no shard')}"
                    for name, file in sorted(weight_map.items()) if self.file_of.get(name) != file]
        problems += [f"{name}: in {self.file_of[name]} but not in the index"
                     for name in sorted(set(self.file_of) - set(weight_map))]
        if problems:
            raise CheckpointError(f"{self.path}: the index and the shard headers disagree", problems)

    def shard_bytes(self, name: str) -> int:
        """Bytes of tensor data in shard ``name`` (from the headers)."""
        return sum(header_bytes(self.headers[t]) for t, f in self.file_of.items() if f == name)

    def load(self, name: str) -> torch.Tensor:
        """One tensor, read from its shard (each shard is opened once and kept open)."""
        from safetensors import safe_open

        file = self.file_of[name]
        try:
            if file not in self._handles:
                self._handles[file] = safe_open(str(self.path / file), framework="pt", device="cpu")
            return self._handles[file].get_tensor(name)
        except Exception as err:  # safetensors raises its own error types; the reason is what matters here
            raise CheckpointError(f"cannot read {name} from {file}: {err}") from err

    def close(self) -> None:
        self._handles.clear()


def header_bytes(header: Header) -> int:
    return math.prod(header.shape) * header.dtype.itemsize
