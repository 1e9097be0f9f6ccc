"""One process's gradients for the replicated inputs of a row-sharded op, from every rank's rows.

Under Ulysses each rank runs an op of the sequence-parallel region on its own rows. Gradients of
the op's row inputs are then per row, and so one process's bits; but the gradient of a replicated
input (a weight, a norm scale, an AdaLN table) is a sum over *all* rows, and a sum of per-rank
partials rounds differently from the one process that summed every row in one fixed order (however
the partials are folded). :func:`exact_replicated_grads` gives the op's replicated inputs the one
process's gradient: its backward all-gathers the op's row inputs and its output gradient in rank
order (the one process's row order, any ``S``, zero-row shards included) and computes the
replicated inputs' gradients from all rows with the op's own backward, the same computation on the
same values on every rank. Nothing is summed across ranks, so the bits do not depend on the number
of ranks, and a hierarchical (intra-node, then inter-node) group gives the flat group's bits.

The price: each rank computes the replicated inputs' gradients over all ``S`` rows (for a linear
layer, the whole dW GEMM, which one rank of ``N`` would otherwise compute over ``S / N`` rows) and
moves the row inputs and output gradient of each such op. The row inputs' gradients still come
from the op's own backward on this rank's rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from flowlock.parallel.collectives import all_gather_rows
from flowlock.parallel.shards import RowShards

# rep_grads(rows_all, dout_all, replicated, needs) -> one gradient per replicated input (None where
# ``needs`` is False)
RepGrads = Callable[[list[torch.Tensor], torch.Tensor, list[torch.Tensor | None], list[bool]],
                    Sequence[torch.Tensor | None]]


def _autograd_rep_grads(op: Callable[..., torch.Tensor]) -> RepGrads:
    def grads(rows_all, dout_all, replicated, needs):
        leaves = [r.detach().requires_grad_(need) if r is not None else None for r, need in zip(replicated, needs)]
        wanted = [leaf for leaf, need in zip(leaves, needs) if need]
        with torch.enable_grad():
            got = iter(torch.autograd.grad(op(*rows_all, *leaves), wanted, dout_all))
        return [next(got) if need else None for need in needs]
    return grads


def exact_replicated_grads(op: Callable[..., torch.Tensor], rows: Sequence[tuple[torch.Tensor, int]],
                           replicated: Sequence[torch.Tensor | None], out_dim: int, shards: RowShards,
                           group: dist.ProcessGroup, rep_grads: RepGrads | None = None) -> torch.Tensor:
    """``op(*row tensors, *replicated)`` on this rank's rows, its replicated inputs' gradients one process's.

    ``rows``: ``(tensor, dim)`` per row input, this rank's rows along ``dim`` (its gradient comes from
    ``op``'s own backward). ``replicated``: the inputs every rank holds whole (None allowed). ``out_dim``:
    the output's row dimension. ``rep_grads(rows_all, dout_all, replicated, needs)``: the replicated
    inputs' gradients from all rows (default: ``op``'s autograd rerun on all rows). Every rank of ``group`` must
    call it for the same op in the same order, as for every collective of the region.
    """
    out = op(*(t for t, _ in rows), *(r.detach() if r is not None else None for r in replicated))
    if not torch.is_grad_enabled() or not any(r is not None and r.requires_grad for r in replicated):
        return out
    spec = ([d for _, d in rows], out_dim, shards, group, rep_grads or _autograd_rep_grads(op))
    return _ReplicatedFromAllRows.apply(out, spec, *(t for t, _ in rows), *replicated)


class _ReplicatedFromAllRows(torch.autograd.Function):
    """Identity on the op's output; backward adds the replicated inputs' gradients from all rows."""

    @staticmethod
    def forward(ctx, out, spec, *inputs):
        ctx.spec = spec
        ctx.save_for_backward(*inputs)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, dout):
        row_dims, out_dim, shards, group, rep_grads = ctx.spec
        n_rows = len(row_dims)
        saved = ctx.saved_tensors  # read once: checkpointed recomputation allows one unpack
        rows, replicated = saved[:n_rows], saved[n_rows:]
        rows_all = [all_gather_rows(t.detach(), dim, shards, group) for t, dim in zip(rows, row_dims)]
        dout_all = all_gather_rows(dout.contiguous(), out_dim, shards, group)
        needs = [r is not None and need for r, need in zip(replicated, ctx.needs_input_grad[2 + n_rows:])]
        grads = rep_grads(rows_all, dout_all, replicated, needs)
        return (dout, None, *([None] * n_rows), *grads)
