"""Shared helpers for flowlock's Triton launchers."""

from __future__ import annotations

import functools

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from flowlock.dispatch import interpreter_active

TORCH_TO_TL_NAME = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@functools.cache
def device_arch(index: int = 0) -> str:
    """``"sm90"`` style architecture key of a CUDA device, ``"interp"`` under the interpreter."""
    if interpreter_active() or not torch.cuda.is_available():
        return "interp"
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm{major}{minor}"


def arch_of(t: torch.Tensor) -> str:
    """Architecture key for the device holding ``t``."""
    return arch_of_device(t.device)


def arch_of_device(device: torch.device) -> str:
    """Architecture key of ``device``: ``"interp"`` off CUDA."""
    if device.type != "cuda":
        return "interp"
    return device_arch(device.index or 0)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host-side grids: ``triton.cdiv`` is a constexpr function whose host call costs
    a few microseconds, which small-S launches feel."""
    return -(-a // b)


def dtype_key(dtype: torch.dtype) -> str:
    """Short dtype key used by the launch-config tables."""
    return TORCH_TO_TL_NAME[dtype]


def traced() -> bool:
    """True while torch.compile/export traces or a dispatch mode (fake, proxy, user) is active.

    Autograd nodes then reach their launchers through the registered custom ops, which tracing must
    see as opaque; eager calls launch directly and skip the op's dispatcher round trip (about 10 us
    of host time per call, measured on CPU), which decides small-S speed.
    """
    return torch.compiler.is_compiling() or is_in_torch_dispatch_mode()
