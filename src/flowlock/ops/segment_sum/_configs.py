"""Per-call launch-config lookup for the norm, gate, GEMM-API and row ops, memoized.

``launch_config`` walks four keys and ``arch_of`` inspects the device on every call (a few us of host
time per launch, which small-S calls feel). The frozen table never changes after import, so the
answer for an ``(op, dtype, device, shape)`` is looked up once and reused.
"""

from __future__ import annotations

import torch

from flowlock.config import LaunchConfig, launch_config
from flowlock.ops._triton_utils import arch_of

_CACHE: dict[tuple[str, torch.dtype, torch.device, tuple[int, ...]], LaunchConfig] = {}


def config_for(op: str, t: torch.Tensor, shape: tuple[int, ...] = (), dtype: torch.dtype | None = None
               ) -> LaunchConfig:
    """``launch_config(op, dtype or t.dtype, arch_of(t), shape)``, memoized per device."""
    key = (op, dtype or t.dtype, t.device, shape)
    cfg = _CACHE.get(key)
    if cfg is None:
        cfg = _CACHE[key] = launch_config(op, key[1], arch_of(t), shape)
    return cfg
