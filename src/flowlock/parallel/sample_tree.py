"""Gradients of micro-batches summed in one fixed tree over their global order.

A data-parallel step sums the gradients of many micro-batches: each rank's own, one after another,
and then across ranks. Both sums are usually folds whose order depends on the layout (a running
``+=`` per rank, then the backend's reduction), so the step's gradient depends on the number of
ranks. flowlock's contract for exact data parallelism instead fixes the sum itself:

* the leaves are the micro-batches' gradients, in their global order ``i = 0 .. B - 1``; rank ``r``
  of ``N`` runs micro-batches ``r, r + N, r + 2N, ...`` (``torch.utils.data.DistributedSampler``'s
  interleaving), its ``k``-th being global micro-batch ``k * N + r``;
* they are summed in fp32 in the pairwise tree :func:`tree_sum` (split at the largest power of two
  below the count) and rounded once to the gradient's dtype.

With ``N`` a power of two, each block of ``N`` consecutive leaves (one micro-batch index ``k`` on
every rank) is a subtree, which the data-parallel reduce-scatter folds
(:class:`flowlock.parallel.exact_fsdp.TreeReduceScatter`); :class:`MicroBatchGradients` folds those
block sums over ``k``, which is the rest of the same tree. So one process and every power-of-two
``N`` give the same bits, provided every layout uses the same micro-batches (same samples, same
micro-batch size, same loss scaling). fp32 addition is commutative, so a node's two children may be
added in either order.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn


def _split(n: int) -> int:
    return 1 << ((n - 1).bit_length() - 1)


def tree_sum(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The fp32 pairwise-tree sum of ``parts`` (same shape; any float dtype, upcast exactly): the
    first ``p`` parts and the rest summed recursively, ``p`` the largest power of two below
    ``len(parts)``. Not rounded. A new tensor."""
    if not parts:
        raise ValueError("tree_sum of no parts")
    if len(parts) == 1:
        return parts[0].to(torch.float32, copy=True)
    p = _split(len(parts))
    return tree_sum(parts[:p]) + tree_sum(parts[p:])


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class MicroBatchGradients:
    """Accumulate the gradients of successive micro-batches in the :func:`tree_sum` tree.

    Call :meth:`add` after each micro-batch's backward: it moves every parameter's gradient (this
    rank's shard under FSDP2) into the tree as fp32 and clears it, so the next backward starts from
    none. The tree is kept as a binary counter: at most ``log2(k) + 1`` fp32 partial sums of the
    gradients after ``k`` micro-batches, plus the last gradient tensors, whose storage
    :meth:`write_` reuses. ``data_parallel_size``: the ``N`` of the data-parallel reduce-scatter that
    already folded each added gradient over ``N`` ranks (1 for one process).

    Refused, at the second :meth:`add` (a single micro-batch is exact on any layout): ``N`` not a
    power of two (its blocks are not subtrees of the tree), and, for ``N > 1``, gradients held in a
    dtype below fp32 (each block sum would be rounded before the fold over ``k``; keep fp32 master
    parameters and reduce in fp32).
    """

    def __init__(self, parameters: Iterable[nn.Parameter], data_parallel_size: int = 1):
        self.parameters = [p for p in parameters if p.requires_grad]
        self.data_parallel_size = data_parallel_size
        self.count = 0
        self._partials: list[tuple[int, list[torch.Tensor | None]]] = []
        self._last: list[torch.Tensor | None] = [None] * len(self.parameters)

    def add(self) -> None:
        """Move every parameter's current gradient into the tree as the next micro-batch's."""
        grads = [p.grad for p in self.parameters]
        if self.count == 1:
            self._check_foldable(grads)
        node = [None if g is None else _local(g).to(torch.float32, copy=True) for g in grads]
        for i, (p, g) in enumerate(zip(self.parameters, grads)):
            if g is not None:
                self._last[i] = g
            p.grad = None
        size = 1
        while self._partials and self._partials[-1][0] == size:
            _, left = self._partials.pop()
            node = [_add(a, b) for a, b in zip(left, node)]
            size *= 2
        self._partials.append((size, node))
        self.count += 1

    def total(self) -> list[torch.Tensor | None]:
        """The fp32 tree sum of the micro-batches added so far, one per parameter (None where no
        micro-batch had a gradient); not rounded."""
        if not self._partials:
            raise RuntimeError("MicroBatchGradients.total before any add")
        acc = self._partials[-1][1]
        for _, left in reversed(self._partials[:-1]):
            acc = [_add(a, b) for a, b in zip(left, acc)]
        return acc

    def write_(self) -> None:
        """Set every parameter's gradient to :meth:`total` rounded once to its dtype, in the storage of
        its last added gradient (a DTensor stays a DTensor), and start a new tree."""
        for p, last, value in zip(self.parameters, self._last, self.total()):
            if value is None:
                continue
            _local(last).copy_(value)
            p.grad = last
        self.count = 0
        self._partials = []
        self._last = [None] * len(self.parameters)

    def _check_foldable(self, grads: list[torch.Tensor | None]) -> None:
        n = self.data_parallel_size
        if n == 1:
            return
        if not _is_power_of_two(n):
            raise ValueError(f"micro-batches folded over {n} data-parallel ranks: exact data parallelism needs a "
                             f"power-of-two degree when a rank runs more than one micro-batch")
        low = sorted({str(g.dtype) for g in grads if g is not None and g.dtype != torch.float32})
        if low:
            raise ValueError(f"micro-batch gradients in {', '.join(low)} under {n} data-parallel ranks: each "
                             "rank's block sum would be rounded before the fold over micro-batches; keep fp32 "
                             "master parameters (FSDP2 MixedPrecisionPolicy(param_dtype=bf16, "
                             "reduce_dtype=float32))")


def _add(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None:
        return b
    if b is None:
        return a
    return a + b
