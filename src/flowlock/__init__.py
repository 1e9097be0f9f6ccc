"""flowlock: exactly on-policy RL for flow-matching diffusion transformers.

Deterministic, batch-invariant kernels and the strict MiniMax-H3 path. Importing flowlock has no
side effects: modes are entered explicitly with :func:`mode` / :func:`set_mode`.
"""

from flowlock import models  # noqa: F401  registers the model families' patch plans (imports none of them)
from flowlock.dispatch import use_backend
from flowlock.finite import nonfinite_check
from flowlock.modes import Fallback, ModeHandle, StrictModeError, current_mode, mode, set_mode
from flowlock.patching import PatchHandle, patch  # diffusers is imported only when patch() runs

__version__ = "0.1.0"

__all__ = [
    "Fallback",
    "ModeHandle",
    "PatchHandle",
    "StrictModeError",
    "current_mode",
    "mode",
    "nonfinite_check",
    "patch",
    "set_mode",
    "use_backend",
]
