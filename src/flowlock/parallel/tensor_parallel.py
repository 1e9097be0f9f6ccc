"""Tensor parallelism that gives one process's bits: no reduction is ever split across ranks.

A :class:`TensorParallel` is a process group of ``N`` ranks that each hold a block of every linear's
weight, in the engine's own sharding (vLLM / Megatron):

* **column-sharded** (output features, ``weight (n / N, K)``, rank ``r`` holding rows
  ``[r·n/N, (r+1)·n/N)``): each rank computes its output columns over the whole ``K``, and
  :meth:`TensorParallel.gather_columns` concatenates them in rank order. With a GEMM whose every output
  element depends only on its X row, its W row and one fixed K order (flowlock's ``linear``), the
  gathered columns are the TP = 1 bits.
* **K-sharded** (input features, ``weight (n, K / N)``, the engine's "row-parallel" linear whose stock
  forward sums ``N`` partial GEMMs with an all-reduce): :meth:`TensorParallel.k_sharded_linear` never
  adds partials. It transposes instead of reducing: one all-to-all turns this rank's K block of
  every row into whole-K rows of a row shard, one all-gather of the weight's K blocks gives the whole
  weight, the GEMM runs over the whole K in its one fixed order, and an all-gather of rows returns
  the full output to every rank. Same FLOPs per rank as the stock split; the weight is gathered per
  call (a transient copy, nothing held between calls, so a weight the engine reloads in place is
  never stale).

The contract is therefore the single-GPU one, untouched: TP = 1 runs no code from this module and
no collective. Forward only (rollout): gathered weights carry no gradient. Collectives only move data
(no float is ever added across ranks), run on the engine's own TP group, and a backend failure (a
dead or stuck peer) raises :class:`~flowlock.parallel.errors.CollectiveError` on every surviving rank.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from flowlock.ops.linear import linear
from flowlock.parallel.collectives import GatherRows, HeadsToSequence, collective
from flowlock.parallel.errors import CollectiveError
from flowlock.parallel.shards import RowShards


def check_divisible(degree: int, widths: Mapping[str, int]) -> None:
    """Raise ValueError naming every width (heads, FFN, ...) that ``degree`` does not divide.

    Each rank of a tensor-parallel layout owns whole heads and equal blocks of every sharded
    dimension; ``widths`` maps a description (``"attention heads"``) to its size.
    """
    if degree < 1:
        raise ValueError(f"the tensor-parallel degree must be >= 1, got {degree}")
    bad = [f"{name} {size} % {degree} != 0" for name, size in widths.items() if size % degree]
    if bad:
        raise ValueError(f"tensor-parallel degree {degree} does not divide the layout: " + "; ".join(bad))


class TensorParallel:
    """``group`` (a ``torch.distributed`` process group of ``degree`` ranks; this one is ``rank``)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.degree = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def agree(self, what: str, contract: Sequence[int], device: torch.device | str = "cpu") -> None:
        """Raise ValueError on every rank unless all ranks pass the same ``contract`` integers.

        One small all-gather (on ``device``, the one the group's backend communicates on); the message
        names ``what`` and each rank's values, so a layout that differs between ranks is refused before
        any block is exchanged.
        """
        mine = torch.tensor([self.degree, *contract], dtype=torch.int64, device=device)
        every = [torch.zeros_like(mine) for _ in range(self.degree)]
        with collective(f"{what} contract all-gather", self.group):
            dist.all_gather(every, mine, group=self.group)
        rows = [t.tolist() for t in every]
        if any(row != rows[self.rank] for row in rows):
            raise ValueError(f"the ranks of a tensor-parallel group disagree on {what} (degree, then "
                             f"{len(contract)} contract values): "
                             + "; ".join(f"rank {r}: {v}" for r, v in enumerate(rows)))

    def gather_blocks(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's equal-shape block of ``x``, concatenated along ``dim`` in rank order."""
        block = x.contiguous()
        parts = [torch.empty_like(block) for _ in range(self.degree)]
        with collective("tensor-parallel all-gather", self.group):
            dist.all_gather(parts, block, group=self.group)
        return torch.cat(parts, dim=dim)

    def gather_columns(self, y: torch.Tensor) -> torch.Tensor:
        """``(..., n / N)`` output columns of a column-sharded linear -> ``(..., n)`` on every rank."""
        return self.gather_blocks(y, dim=-1)

    def k_sharded_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                         rows_epilogue: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
                         ) -> torch.Tensor:
        """``x @ W.T + bias`` of a K-sharded linear with the whole K reduced in one GEMM on each row.

        Args:
            x: ``(S, K / N)``, this rank's K block of every row (replicated rows, e.g. the local heads'
                attention output or the local FFN columns); same ``S`` on every rank.
            weight: ``(n, K / N)``, this rank's K block of ``W`` (the same dtype as ``x``).
            bias: ``(n,)`` or None, the whole bias (added once, inside the GEMM, as at TP = 1).
            rows_epilogue: ``(whole-K rows (s_r, K), output rows (s_r, n)) -> output rows``, run on this
                rank's row shard before the rows are gathered: the place for another row-pure term on the
                same input (a LoRA adapter's ``linear(linear(x, A), B)``, from its gathered ``A``).

        Returns ``(S, n)`` in ``x``'s dtype, the same on every rank and bitwise ``linear(x_full, W,
        bias)`` of one process: row ``s`` is computed on the rank owning it (``RowShards`` of ``S``
        rows, so any ``S``, zero-row shards included) from its whole-K row and ``W``.

        Bytes received per rank: ``(N-1)/N · S · K / N`` (the all-to-all) ``+ (N-1)/N · S · n`` (the
        row gather) ``+ (N-1)/N · n · K`` (the weight), against ``2 (N-1)/N · S · n`` for a ring
        all-reduce of the stock partial sums.
        """
        if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
            raise ValueError(f"k_sharded_linear needs x (S, K/N) and weight (n, K/N), got {tuple(x.shape)} "
                             f"and {tuple(weight.shape)}")
        shards = RowShards(x.shape[0], self.degree, self.rank)
        # (S, 1, K/N) on every rank -> (s_r, N, K/N): block j is rank j's K block of this rank's rows
        # (Ulysses' heads-to-sequence exchange with one "head" of width K/N per rank).
        try:
            rows = HeadsToSequence.apply(x.unsqueeze(1), shards, self.group).flatten(1)
        except CollectiveError as err:
            raise CollectiveError(f"tensor-parallel K-sharded linear (all-to-all to whole-K rows): {err}") from err
        full = self.gather_blocks(weight, dim=1)
        out = linear(rows, full, bias)
        if rows_epilogue is not None:
            out = rows_epilogue(rows, out)
        return GatherRows.apply(out, 0, shards, self.group)
