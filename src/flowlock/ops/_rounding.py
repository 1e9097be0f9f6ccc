"""Rounding points for FP64 goldens.

A golden computes in float64 and rounds only where the model stores a value in its own dtype.
:func:`st_round` rounds in the forward and is the identity in the backward (straight-through), so a
golden's gradient measures the arithmetic, not the derivative of a step function.
"""

from __future__ import annotations

import torch


def st_round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round ``x`` to ``dtype`` and back, with a straight-through gradient; ``x``'s dtype is kept."""
    if dtype == torch.float64:
        return x
    return x + (x.to(dtype).to(x.dtype) - x).detach()
