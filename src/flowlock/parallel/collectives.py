"""The collectives flowlock issues, as autograd functions that only move data.

Every function here copies values between ranks and never adds them, so forward and backward are
bitwise the values a single process holds. Collectives use equal-size blocks (each rank's rows padded
to ``ceil(S / N)``), which every backend supports, gloo included; the padding is sliced away and never
reaches arithmetic. A backend failure (a peer that died, a timeout) is re-raised as
:class:`~flowlock.parallel.errors.CollectiveError` on every surviving rank.

Autograd pairs (each function's backward is the other's forward):

* :class:`ShardRows` (keep own rows) / all-gather of gradient rows, so a replicated producer upstream of
  the split receives the full gradient on every rank;
* :class:`GatherRows` (all-gather rows) / keep own gradient rows, valid because every rank computes the
  same loss from the replicated gathered tensor;
* :class:`SequenceToHeads` / :class:`HeadsToSequence`: the Ulysses all-to-alls.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from flowlock.parallel.errors import CollectiveError
from flowlock.parallel.shards import RowShards


@contextlib.contextmanager
def collective(what: str, group: dist.ProcessGroup):
    """Run the collective ``what`` on ``group``, turning a backend error into CollectiveError."""
    try:
        yield
    except (RuntimeError, dist.DistError) as err:
        if isinstance(err, CollectiveError):
            raise
        raise CollectiveError(f"flowlock {what} failed on rank {dist.get_rank(group)} of a group of "
                              f"{dist.get_world_size(group)}: {err}") from err


def _pad_rows(x: torch.Tensor, dim: int, rows: int) -> torch.Tensor:
    missing = rows - x.shape[dim]
    if missing == 0:
        return x.contiguous()
    pad_shape = list(x.shape)
    pad_shape[dim] = missing
    return torch.cat([x, x.new_zeros(pad_shape)], dim=dim)


def all_gather_rows(x: torch.Tensor, dim: int, shards: RowShards, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's rows of ``x`` along ``dim``, concatenated in rank order (``shards.seq_len`` rows)."""
    block = _pad_rows(x, dim, shards.padded)
    parts = [torch.zeros_like(block) for _ in range(shards.degree)]
    with collective("row all-gather", group):
        dist.all_gather(parts, block, group=group)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, shards.sizes)], dim=dim)


def gather_from_ranks(t: torch.Tensor, group: dist.ProcessGroup) -> list[torch.Tensor]:
    """Every rank's ``t`` (one shape and dtype on every rank of ``group``), in rank order."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    with collective("all-gather", group):
        dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value on every rank (its mesh's all-gather); a plain tensor as it is."""
    if not hasattr(t, "full_tensor"):
        return t
    with collective("DTensor all-gather", t.device_mesh.get_group()):
        return t.full_tensor()


def own_rows(x: torch.Tensor, dim: int, shards: RowShards) -> torch.Tensor:
    start, end = shards.bounds()
    return x.narrow(dim, start, end - start).contiguous()


class ShardRows(torch.autograd.Function):
    """(…, S, …) replicated -> this rank's (…, s_r, …); backward all-gathers the gradient rows."""

    @staticmethod
    def forward(ctx, x, dim, shards, group):
        ctx.args = (dim, shards, group)
        return own_rows(x, dim, shards)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_rows(grad, *ctx.args), None, None, None


class GatherRows(torch.autograd.Function):
    """(…, s_r, …) -> (…, S, …) replicated; backward keeps this rank's gradient rows."""

    @staticmethod
    def forward(ctx, x, dim, shards, group):
        ctx.args = (dim, shards)
        return all_gather_rows(x, dim, shards, group)

    @staticmethod
    def backward(ctx, grad):
        return own_rows(grad, *ctx.args), None, None, None


def _sequence_to_heads(x: torch.Tensor, shards: RowShards, group: dist.ProcessGroup) -> torch.Tensor:
    # (*lead, s_r, H, D) -> (N, *lead, m, H/N, D): block j holds this rank's rows of head group j.
    n = shards.degree
    send = _pad_rows(x, -3, shards.padded).unflatten(-2, (n, -1)).movedim(-3, 0).contiguous()
    recv = torch.zeros_like(send)
    with collective("Ulysses all-to-all (sequence to heads)", group):
        dist.all_to_all_single(recv, send, group=group)
    # block j now holds rank j's rows of this rank's head group
    return torch.cat([recv[j].narrow(-3, 0, size) for j, size in enumerate(shards.sizes)], dim=-3)


def _heads_to_sequence(x: torch.Tensor, shards: RowShards, group: dist.ProcessGroup) -> torch.Tensor:
    # (*lead, S, H/N, D) -> (N, *lead, m, H/N, D): block j holds rank j's rows of this rank's heads.
    send = torch.stack([_pad_rows(part, -3, shards.padded) for part in x.split(shards.sizes, dim=-3)])
    recv = torch.zeros_like(send)
    with collective("Ulysses all-to-all (heads to sequence)", group):
        dist.all_to_all_single(recv, send, group=group)
    # block j now holds this rank's rows of head group j
    out = recv.movedim(0, -3).flatten(-3, -2)
    return out.narrow(-3, 0, shards.sizes[shards.rank]).contiguous()


class SequenceToHeads(torch.autograd.Function):
    """(…, s_r, H, D) row shard, all heads -> (…, S, H/N, D) all rows, this rank's head group.

    Rank r's head group is heads ``[r·H/N, (r+1)·H/N)``. Backward is :class:`HeadsToSequence`'s forward.
    """

    @staticmethod
    def forward(ctx, x, shards, group):
        ctx.args = (shards, group)
        return _sequence_to_heads(x, shards, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_sequence(grad, *ctx.args), None, None


class HeadsToSequence(torch.autograd.Function):
    """The inverse of :class:`SequenceToHeads`: (…, S, H/N, D) -> (…, s_r, H, D)."""

    @staticmethod
    def forward(ctx, x, shards, group):
        ctx.args = (shards, group)
        return _heads_to_sequence(x, shards, group)

    @staticmethod
    def backward(ctx, grad):
        return _sequence_to_heads(grad, *ctx.args), None, None
