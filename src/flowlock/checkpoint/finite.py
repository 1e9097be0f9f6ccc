"""The non-finite check of ``flowlock convert``: every tensor is counted as it is read, never read twice."""

from __future__ import annotations

import torch

from flowlock.checkpoint.directory import SafetensorsDirectory

# Elements per pass of the exact count: its own memory stays at 16 Mi bools whatever the tensor's size.
_CHUNK = 1 << 24


def _count(tensor: torch.Tensor, test) -> int:
    return sum(int(test(chunk).sum()) for chunk in tensor.reshape(-1).split(_CHUNK))


def nonfinite_count(tensor: torch.Tensor) -> int:
    """Elements of ``tensor`` that are NaN, +Inf or -Inf (0 for a tensor that is not floating point)."""
    if not tensor.dtype.is_floating_point:
        return 0
    # The sum is finite only if every element is (IEEE addition propagates NaN and Inf, and Inf + -Inf
    # is NaN): one pass with no temporary, about 20x faster than isfinite on the CPU. A sum of finite
    # values can still overflow, so a non-finite sum is only a suspicion the exact count settles.
    if bool(torch.isfinite(tensor.sum())):
        return 0
    return _count(tensor, lambda chunk: torch.isfinite(chunk).logical_not_())


class FiniteLoader:
    """``source.load`` that counts the non-finite elements of each tensor it hands out.

    ``findings`` gets one line per tensor that holds any: its name, its shard file and the counts.
    """

    def __init__(self, source: SafetensorsDirectory) -> None:
        self.source = source
        self.findings: list[str] = []

    def load(self, name: str) -> torch.Tensor:
        tensor = self.source.load(name)
        bad = nonfinite_count(tensor)
        if bad:
            nan = _count(tensor, torch.isnan)
            self.findings.append(f"{name} in {self.source.file_of[name]}: {bad} of {tensor.numel()} elements are "
                                 f"not finite ({nan} NaN, {bad - nan} Inf)")
        return tensor
