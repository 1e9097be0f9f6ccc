"""``fixed_order_mean``: a per-sample mean whose bits depend only on the sample's own row.

Each row of ``(B, N)`` is cut into fixed tiles of 256 elements (the last zero-padded; adding
``+0`` is exact). Inside a tile a pairwise tree adds neighbours at strides 1, 2, ..., 128; the tile
sums, zero-padded to a power-of-two count, are folded by the same pairwise tree, and the total is
divided by ``N``. A tree rather than a left fold keeps the launch count logarithmic in ``N``
(a left fold cost one launch per tile: about 12k at H3 video sizes). Every
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
    sums = _pairwise_tree(x.reshape(b, tiles, TILE))
    padded = 1 << (tiles - 1).bit_length()
    if padded != tiles:
        sums = torch.cat([sums, sums.new_zeros(b, padded - tiles)], dim=1)
    return _pairwise_tree(sums) / n


def _pairwise_tree(x: torch.Tensor) -> torch.Tensor:
    """Sum the last dim (a power of two) by adding neighbours at strides 1, 2, 4, ..."""
    while x.shape[-1] > 1:
        pairs = x.reshape(*x.shape[:-1], -1, 2)
        x = pairs[..., 0] + pairs[..., 1]
    return x[..., 0]
