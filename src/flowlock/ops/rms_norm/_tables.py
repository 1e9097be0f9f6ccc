"""Validation shared by the ops that read rows of an AdaLN table (rms_norm_modulate, gate_residual)."""

from __future__ import annotations

import math

import torch

from flowlock.ops._validate import check_tensor


def check_table(name: str, table: object, *, dtype: torch.dtype, width: int, device: torch.device,
                rows: int | None = None) -> torch.Tensor:
    """A ``(R, width)`` table of ``dtype`` or float32 with unit column stride (a column view of the
    ``(3T, 6H)`` AdaLN table qualifies); ``rows`` fixes ``R`` when given."""
    check_tensor(name, table, dtypes=(dtype, torch.float32), ndim=2, device=device)
    r, w = table.shape
    if w != width or (rows is not None and r != rows):
        want = ("*" if rows is None else rows, width)
        raise ValueError(f"{name} must have shape {want}, got {tuple(table.shape)}")
    if r < 1:
        raise ValueError(f"{name} must have at least one row")
    if width > 1 and table.stride(1) != 1:
        raise ValueError(f"{name} must have unit column stride, got strides {table.stride()}")
    return table


def check_eps(eps: object) -> float:
    """``eps``: a finite, non-negative real number."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    if not (0.0 <= float(eps) < math.inf):
        raise ValueError(f"eps must be finite and >= 0, got {eps}")
    return float(eps)


def check_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")
