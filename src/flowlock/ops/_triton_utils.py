"""Shared helpers for flowlock's Triton launchers."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host-side grids: ``triton.cdiv`` is a constexpr function whose host call costs
    a few microseconds, which small-S launches feel."""
    return -(-a // b)


def traced() -> bool:
    """True while torch.compile/export traces or a dispatch mode (fake, proxy, user) is active.

    Autograd nodes then reach their launchers through the registered custom ops, which tracing must
    see as opaque; eager calls launch directly and skip the op's dispatcher round trip (about 10 us
    of host time per call, measured on CPU), which decides small-S speed.
    """
    return torch.compiler.is_compiling() or is_in_torch_dispatch_mode()
