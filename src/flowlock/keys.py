"""The keys of flowlock's frozen launch-config tables: a device's architecture and a dtype's short
name. Below both :mod:`flowlock.config` and the ops, which key their configs by them."""

from __future__ import annotations

import functools

import torch

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


def dtype_key(dtype: torch.dtype) -> str:
    """Short dtype key used by the launch-config tables."""
    return TORCH_TO_TL_NAME[dtype]
