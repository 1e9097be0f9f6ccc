"""Execution modes: strict, audit and provider.

``strict`` (the default) runs flowlock arithmetic only; anything that cannot run raises
:class:`StrictModeError` and nothing falls back. ``audit`` runs the same path but lets a step that
flowlock cannot serve fall back to the provider (stock diffusers / PyTorch), and records every such
fallback as ``(op, reason)``. ``provider`` runs the stock path, for A/B comparison.

Modes nest: ``with flowlock.mode("audit") as handle:`` pushes a frame and pops it on exit, even on
error, so an inner block never tears down an outer one. :func:`set_mode` is the handle API for code
that cannot use a ``with`` block; it returns a :class:`ModeHandle` whose ``restore()`` pops exactly
that frame. Nothing here has side effects at import.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

MODES = ("strict", "audit", "provider")


class StrictModeError(RuntimeError):
    """Raised in strict mode when a step cannot run on the flowlock path."""


@dataclass(frozen=True)
class Fallback:
    """One recorded fallback to the provider: which op and why."""

    op: str
    reason: str


@dataclass
class ModeHandle:
    """A pushed mode frame. ``ran`` lists ``(op, backend)`` of every flowlock op executed while the
    frame was active (innermost frame only), ``fallbacks`` every audit-mode fallback."""

    mode: str
    ran: list[tuple[str, str]] = field(default_factory=list)
    fallbacks: list[Fallback] = field(default_factory=list)
    _active: bool = True

    def restore(self) -> None:
        """Pop this frame. Frames must be popped in reverse order of pushing."""
        stack = _stack()
        if not self._active:
            raise RuntimeError("this mode frame was already restored")
        if not stack or stack[-1] is not self:
            raise RuntimeError("mode frames must be restored innermost first")
        stack.pop()
        self._active = False


_local = threading.local()


def _stack() -> list[ModeHandle]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def current_mode() -> str:
    """The innermost active mode, ``"strict"`` when none was set."""
    stack = _stack()
    return stack[-1].mode if stack else "strict"


def set_mode(mode: str) -> ModeHandle:
    """Push ``mode`` and return its handle; call ``handle.restore()`` to pop it."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    handle = ModeHandle(mode)
    _stack().append(handle)
    return handle


@contextmanager
def mode(name: str):
    """Reentrant context manager: ``with mode("audit") as handle: ...``."""
    handle = set_mode(name)
    try:
        yield handle
    finally:
        handle.restore()


# One shared ``(op, backend)`` tuple per pair: appending a new tuple per call would grow the
# garbage collector's tracked set with every op run and make each append cost microseconds.
_PAIRS: dict[tuple[str, str], tuple[str, str]] = {}


def record_run(op: str, backend: str) -> None:
    """Note that ``op`` ran on ``backend`` in the innermost frame (no-op outside any frame, and
    while torch.compile traces: a graph cannot replay a Python list append, and dynamo would guard
    on the frame's growing record and recompile every call)."""
    stack = getattr(_local, "stack", None)
    if stack and not torch.compiler.is_compiling():
        key = (op, backend)
        stack[-1].ran.append(_PAIRS.setdefault(key, key))


def fallback_or_raise(op: str, reason: str) -> None:
    """Called where flowlock cannot serve ``op``. In strict mode raise; in audit mode record the
    fallback and return so the caller runs the provider path; in provider mode just return."""
    current = current_mode()
    if current == "strict":
        raise StrictModeError(f"{op}: {reason} (strict mode never falls back)")
    if current == "audit":
        _stack()[-1].fallbacks.append(Fallback(op, reason))
