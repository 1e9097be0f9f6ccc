"""Parallel layouts that give one process's bits; the only place flowlock issues collectives.

flowlock runs inside the engines' own parallelism and replaces the pieces whose arithmetic depends
on the layout. Here: Ulysses sequence parallelism on row shards at any sequence length, forward and
backward (:class:`Ulysses`), a fixed-order sum of per-rank gradient partials (:func:`fold_sum_`), and
one process's gradients of a row-sharded op's replicated inputs from all rows
(:func:`exact_replicated_grads`), and data-parallel gradients summed in one fixed tree over the global
micro-batch order (:class:`MicroBatchGradients`, FSDP2's reduce-scatter through
:func:`exact_data_parallel`).
Model packages import this layer (models -> parallel -> torch.distributed); it imports no model.
"""

from flowlock.parallel.errors import CollectiveError
from flowlock.parallel.exact_fsdp import TreeReduceScatter, exact_data_parallel
from flowlock.parallel.exact_grads import exact_replicated_grads
from flowlock.parallel.grads import fold_sum_
from flowlock.parallel.sample_tree import MicroBatchGradients, tree_sum
from flowlock.parallel.shards import RowShards
from flowlock.parallel.ulysses import Ulysses, UlyssesSequence, check_heads

__all__ = ["CollectiveError", "MicroBatchGradients", "RowShards", "TreeReduceScatter", "Ulysses", "UlyssesSequence",
           "check_heads", "exact_data_parallel", "exact_replicated_grads", "fold_sum_", "tree_sum"]
