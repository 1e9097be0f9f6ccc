"""Strict mode's non-finite input check, and the switch that turns it off.

A NaN or Inf in one sample's latents flows through the strict path silently (batch invariance keeps
it out of the other samples, but that sample's outputs, log-probs and gradients are garbage), so the
strict forward checks its floating inputs before any op runs: :func:`check_finite_samples` reduces
every tensor to one flag per sample on the device and reads them all back with ONE host sync; only
when a flag is set does it look further, to name the tensor and the sample.

The sync is skipped where it is illegal or breaks a graph: while ``torch.compile`` traces and while a
CUDA graph is being captured (the graphed H3 path checks each replay's inputs on the host before it
copies them). ``with flowlock.nonfinite_check(False):`` turns the check off (thread-local and
reentrant, like :func:`flowlock.mode`), for callers who cannot afford a sync per forward
(``benchmarks/bench_nonfinite.py`` measures its cost at full depth on a GPU).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from contextlib import contextmanager

import torch

_local = threading.local()


def nonfinite_check_enabled() -> bool:
    """Whether strict forwards on this thread check their floating inputs (on unless switched off)."""
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else True


@contextmanager
def nonfinite_check(enabled: bool):
    """``with flowlock.nonfinite_check(False):`` strict forwards in the block skip the check."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    if not hasattr(_local, "stack"):
        _local.stack = []
    _local.stack.append(enabled)
    try:
        yield
    finally:
        _local.stack.pop()


def check_finite_samples(named: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Raise ValueError naming the first tensor and sample that holds a NaN or Inf.

    ``named``: ``(name, tensor)`` pairs, each tensor floating with the samples on dim 0 (any trailing
    shape, empty allowed). Costs one small reduction per tensor and one host read for all of them; a
    no-op while switched off, while ``torch.compile`` traces or while a CUDA graph is being captured.
    """
    if not named or not nonfinite_check_enabled() or torch.compiler.is_compiling():
        return
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return
    flags = [torch.isfinite(t).flatten(1).all(1) if t.ndim > 1 else torch.isfinite(t) for _, t in named]
    if all(torch.cat(flags).tolist()):
        return
    for (name, t), flag in zip(named, flags):
        bad = (~flag).nonzero()
        if bad.numel():
            sample = int(bad[0])
            values = t[sample]
            kind = "NaN" if bool(torch.isnan(values).any()) else "Inf"
            where = tuple(int(i) for i in (~torch.isfinite(values)).nonzero()[0])
            raise ValueError(f"{name} holds {kind} in sample {sample} (first at index {where} of that sample): "
                             "strict mode refuses non-finite inputs, whose outputs and gradients would be "
                             "non-finite without a word; flowlock.nonfinite_check(False) turns this check off")
