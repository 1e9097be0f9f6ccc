"""Whether a call must record an autograd node.

Public ops reach their Triton launchers through an autograd ``Function`` only when a gradient can
flow; a call under ``torch.no_grad`` (a rollout, an evaluation) or on tensors that need no gradient
calls the same forward launcher directly. Both paths run the same kernels on the same arguments, so
their outputs are the same bits; skipping ``Function.apply`` saves about 10-15 us of host time per
call, which decides small-S speed.
"""

from __future__ import annotations

import torch


def needs_graph(*tensors: torch.Tensor | None) -> bool:
    """True when grad mode is on and any of ``tensors`` (``None`` entries ignored) requires grad."""
    if not torch.is_grad_enabled():
        return False
    return any(t is not None and t.requires_grad for t in tensors)
