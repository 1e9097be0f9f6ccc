"""Memoized launch-config lookup for the AdaLN family's launchers."""

from __future__ import annotations

import torch

from flowlock.config import LaunchConfig, launch_config
from flowlock.ops._triton_utils import arch_of

_CONFIGS: dict[tuple[str, torch.dtype, torch.device], LaunchConfig] = {}


def config(op: str, t: torch.Tensor) -> LaunchConfig:
    """``launch_config(op, t.dtype, arch_of(t))``, memoized per (op, dtype, device): the frozen table
    never changes after import, and walking it costs a few us of host time per launch."""
    key = (op, t.dtype, t.device)
    cfg = _CONFIGS.get(key)
    if cfg is None:
        cfg = _CONFIGS[key] = launch_config(op, t.dtype, arch_of(t))
    return cfg
