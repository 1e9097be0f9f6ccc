"""``fixed_order_mean``: a per-sample mean whose bits depend only on the sample's own row.

Each row of ``(B, N)`` is cut into fixed tiles of 256 elements (the last zero-padded; adding
``+0`` is exact). Inside a tile a pairwise tree adds neighbours at strides 1, 2, ..., 128; tile
sums are then folded left to right in ascending order and the total is divided by ``N``. Every
step is an elementwise torch op on whole rows, so the order of additions is fixed by ``N`` alone —
not by ``B``, the device's vector width or thread count — and autograd flows through it.
"""

from __future__ import annotations

import torch

TILE = 256


def fixed_order_mean(x: torch.Tensor) -> torch.Tensor:
    """Mean over dim 1 of ``x`` (``(B, N)``, float32 or float64, ``N >= 1``) -> ``(B,)``, same dtype.

    Differentiable; batch-invariant and repeatable bitwise.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"x must be float32 or float64, got {x.dtype}")
    if x.ndim != 2 or x.shape[1] < 1:
        raise ValueError(f"x must be (B, N) with N >= 1, got shape {tuple(x.shape)}")
    b, n = x.shape
    tiles = -(-n // TILE)
    if tiles * TILE != n:
        x = torch.cat([x, x.new_zeros(b, tiles * TILE - n)], dim=1)
    level = x.reshape(b, tiles, TILE)
    while level.shape[-1] > 1:
        pairs = level.reshape(b, tiles, -1, 2)
        level = pairs[..., 0] + pairs[..., 1]
    sums = level[..., 0]
    total = sums[:, 0]
    for t in range(1, tiles):
        total = total + sums[:, t]
    return total / n
