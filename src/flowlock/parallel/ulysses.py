"""Ulysses sequence parallelism that gives one process's bits, at any sequence length.

A :class:`Ulysses` layout is a process group of ``N`` ranks that hold the same sample. A model's
sequence-parallel region runs on a row shard per rank (:class:`~flowlock.parallel.shards.RowShards`,
uneven when ``N`` does not divide ``S``, empty when ``S < N``); its attention exchanges rows for heads
(:meth:`UlyssesSequence.attention`), so every (sample, head, row) of attention sees all ``S`` keys, and
every other op sees whole rows with their full reduction dimension. With row-invariant kernels each
rank's rows are therefore bitwise the single-process rows. Forward and backward only move data.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from flowlock.parallel.collectives import (
    GatherRows,
    HeadsToSequence,
    SequenceToHeads,
    ShardRows,
    collective,
    own_rows,
)
from flowlock.parallel.exact_grads import RepGrads, exact_replicated_grads
from flowlock.parallel.shards import RowShards


def check_heads(heads: int, degree: int, what: str = "attention") -> None:
    """Raise ValueError unless ``degree`` divides ``heads`` (each rank takes ``heads / degree`` whole heads)."""
    if degree < 1:
        raise ValueError(f"the Ulysses degree must be >= 1, got {degree}")
    if heads % degree:
        divisors = [d for d in range(1, heads + 1) if heads % d == 0]
        raise ValueError(f"Ulysses degree {degree} does not divide the {heads} heads of {what}: each rank must "
                         f"own whole heads (supported degrees: {divisors})")


class Ulysses:
    """A Ulysses group: ``group`` (``None``: the default group) of ``degree`` ranks holding one sample."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group if group is not None else dist.group.WORLD
        self.degree = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)

    def for_sequence(self, seq_len: int, contract: Sequence[int] = (), device: torch.device | str = "cpu",
                     exact_parameter_gradients: bool = False) -> UlyssesSequence:
        """The row shards of one forward over ``seq_len`` rows.

        ``exact_parameter_gradients``: the region's ops give their replicated inputs one process's
        gradients (:meth:`UlyssesSequence.exact`); part of the contract the ranks must agree on.

        ``contract`` is what every rank must agree on besides ``seq_len`` (batch, heads, widths): it is
        compared across the group with one small all-gather, and a rank that differs raises ValueError
        naming the ranks and values on every rank, instead of exchanging mismatched blocks. ``device``
        holds that small tensor: the one the group's backend communicates on (CPU for gloo).
        """
        values = [seq_len, self.degree, int(exact_parameter_gradients), *contract]
        mine = torch.tensor(values, dtype=torch.int64, device=device)
        every = [torch.zeros_like(mine) for _ in range(self.degree)]
        with collective("layout contract all-gather", self.group):
            dist.all_gather(every, mine, group=self.group)
        rows = [t.tolist() for t in every]
        if any(r != values for r in rows):
            raise ValueError(f"the ranks of a Ulysses group disagree on the layout (sequence length, degree, "
                             f"exact parameter gradients, then {len(contract)} contract values): " + "; ".join(
                                 f"rank {r}: {v}" for r, v in enumerate(rows)))
        return UlyssesSequence(RowShards(seq_len, self.degree, self.rank), self.group, exact_parameter_gradients)


class UlyssesSequence:
    """One forward's sequence shards and the data movement between replicated and sharded regions."""

    def __init__(self, shards: RowShards, group: dist.ProcessGroup, exact_parameter_gradients: bool = False):
        self.shards = shards
        self.group = group
        self.exact_parameter_gradients = exact_parameter_gradients

    def exact(self, op: Callable[..., torch.Tensor], rows: Sequence[tuple[torch.Tensor, int]],
              replicated: Sequence[torch.Tensor | None], out_dim: int, rep_grads: RepGrads | None = None
              ) -> torch.Tensor:
        """``op`` on this rank's rows with its replicated inputs' gradients one process's bits: see
        :func:`flowlock.parallel.exact_grads.exact_replicated_grads` (same arguments)."""
        return exact_replicated_grads(op, rows, replicated, out_dim, self.shards, self.group, rep_grads)

    def shard(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Replicated ``x`` -> this rank's rows along ``dim``, contiguous. Differentiable: the backward all-gathers the
        gradient rows, so each rank's gradient of ``x`` is the full single-process gradient."""
        if x.requires_grad:
            return ShardRows.apply(x, dim, self.shards, self.group)
        return own_rows(x, dim, self.shards)

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's rows -> all rows along ``dim`` on every rank. Differentiable: the backward keeps
        this rank's gradient rows, which assumes every rank computes the same loss from the result."""
        return GatherRows.apply(x, dim, self.shards, self.group)

    def attention(self, attend: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor) -> torch.Tensor:
        """``attend(q, k, v)`` over all rows for this rank's heads, on row shards.

        ``q``, ``k``, ``v``: (B, s_r, H, D), this rank's rows with all heads. One all-to-all moves the
        three together (one collective, one backward node), ``attend`` runs on (B, S, H/N, D), and the
        inverse all-to-all returns (B, s_r, H, D). ``attend`` must treat heads independently.
        """
        qkv = SequenceToHeads.apply(torch.stack((q, k, v)), self.shards, self.group)
        out = attend(*qkv.unbind(0))
        return HeadsToSequence.apply(out, self.shards, self.group)
