"""Sum of per-rank gradient partials in one fixed order, the same bits on every rank.

Ranks of a Ulysses group each hold the gradient contribution of their own rows to the parameters
that act on sharded rows; the full gradient is their sum. :func:`fold_sum_` computes it without the
backend's reduction (whose order depends on algorithm, channel count and message size): an all-to-all
gives rank ``j`` chunk ``j`` of every rank's partial, rank ``j`` folds those ``N`` chunks left in rank
order in fp32 (``((p_0 + p_1) + p_2) + …``) and rounds once to the gradient's dtype, and an all-gather
returns the chunks. The bits depend only on the partials and ``N``: repeatable, identical on every
rank, and independent of the backend. Traffic equals a ring all-reduce of the fp32 partials; memory
is two fp32 copies of one bucket.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from flowlock.parallel.collectives import collective

BUCKET_ELEMENTS = 1 << 24


def _local(t: torch.Tensor) -> torch.Tensor:
    # FSDP2 gradients are DTensors: the fold acts on this rank's shard, which every peer of the
    # Ulysses group holds at the same offsets (the group spans one FSDP shard index).
    return t.to_local() if hasattr(t, "to_local") else t


def fold_sum_(tensors: Iterable[torch.Tensor], group: dist.ProcessGroup | None = None,
              bucket_elements: int = BUCKET_ELEMENTS) -> None:
    """Replace every tensor in ``tensors`` (same list, same shapes on every rank of ``group``) by the
    rank-ordered fp32 fold of its values over ``group``, rounded once to its dtype. In place."""
    group = group if group is not None else dist.group.WORLD
    n = dist.get_world_size(group)
    bucket: list[torch.Tensor] = []
    filled = 0
    for t in (_local(t) for t in tensors):
        if bucket and filled + t.numel() > bucket_elements:
            _fold_bucket(bucket, group, n)
            bucket, filled = [], 0
        bucket.append(t)
        filled += t.numel()
    if bucket:
        _fold_bucket(bucket, group, n)


def _fold_bucket(bucket: list[torch.Tensor], group: dist.ProcessGroup, n: int) -> None:
    flat = torch.cat([t.detach().reshape(-1).float() for t in bucket])
    chunk = -(-flat.numel() // n)
    send = torch.cat([flat, flat.new_zeros(chunk * n - flat.numel())]).view(n, chunk)
    recv = torch.zeros_like(send)
    with collective("gradient fold all-to-all", group):
        dist.all_to_all_single(recv, send, group=group)
    total = recv[0].clone()
    for j in range(1, n):
        total += recv[j]
    rounded = [torch.zeros_like(total) for _ in range(n)]
    with collective("gradient fold all-gather", group):
        dist.all_gather(rounded, total, group=group)
    out = torch.cat(rounded)[:flat.numel()]
    offset = 0
    for t in bucket:
        t.copy_(out[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
