"""diffusers context parallelism (``enable_parallelism(ContextParallelConfig(ulysses_degree=N))``) on
the strict H3 path, giving one process's bits on every rank.

diffusers' ``_cp_plan`` hooks split the packed sequence at the first block and gather it at the output
heads; ``flowlock.patch`` (applied after ``enable_parallelism``) replaces those hooked forwards, and the
strict forward makes the same cut itself with :mod:`flowlock.parallel`:

* replicated on every rank, as in diffusers: the input projections, the token refiner (whose rows
  are replicated, so its attention stays local: routed through the all-to-all it would attend over
  the text ``N`` times), the packed buffer, the timestep embedding, RoPE;
* sharded: ``x``, the per-row AdaLN / timestep indices and RoPE rows, split on
  ``torch.tensor_split`` boundaries (any ``S``, also ``S < N``); each transformer block's attention
  exchanges rows for heads; ``norm_out`` runs on the shard and its rows are all-gathered before the
  output heads select video and audio rows.

The split's backward all-gathers the gradient rows, so the replicated producers (inputs, refiner)
get the full gradient on every rank: input gradients and their parameters' gradients are the
single-process bits. Parameters applied to sharded rows (:func:`row_sharded_parameters`) get each
rank's rows' contribution; :func:`reduce_gradients` sums those over the Ulysses group in one fixed
order. Ring attention is refused (:func:`unsupported_reason`).

:func:`exact_parameter_gradients` is the option that makes those gradients one process's bits too:
each op of the sharded region computes its replicated inputs' gradients (weights, norm scales, the
AdaLN tables, hence the timestep embedding's) from every rank's rows
(:func:`flowlock.parallel.exact_grads.exact_replicated_grads`), so nothing is left to fold and
:func:`reduce_gradients` does nothing. It costs each rank the weight-gradient work of all ``S`` rows
and the traffic of each op's rows (docs/layouts.md has the numbers).
"""

from __future__ import annotations

import types

import torch
from torch import nn

from flowlock.ops._validate import memoized_over
from flowlock.parallel import Ulysses, UlyssesSequence, check_heads, fold_sum_

# Set on a model by exact_parameter_gradients; read by every forward (sequence_plan).
EXACT_PARAMETER_GRADIENTS = "_flowlock_exact_parameter_gradients"

# Prefixes of the parameters applied to sharded rows: the blocks, norm_out, and the timestep
# embedding, whose output feeds the AdaLN tables indexed by sharded rows.
ROW_SHARDED = ("transformer_blocks.", "norm_out.", "time_embedder.")
# Modules whose output is replicated (one value for the whole sample, or batch) but consumed by the
# sharded rows: under Ulysses (and data parallelism) each rank's gradient of that output is its own
# rows' (samples') contribution, summed only in the parameter gradients (reduce_gradients).
PARTIAL_OUTPUT_GRADIENTS = ("time_embedder",)


def context_parallel_config(model: nn.Module):
    """The ``ContextParallelConfig`` diffusers' ``enable_parallelism`` recorded on ``model``, or None."""
    config = getattr(model, "_parallel_config", None)
    return None if config is None else config.context_parallel_config


def exact_parameter_gradients(model: nn.Module, enabled: bool = True) -> None:
    """Make ``model``'s Ulysses parameter gradients one process's bits on every rank (``enabled``), or
    the rank-order fold of per-rank partials (the default, cheaper). Eager strict forwards only: a
    forward traced by ``torch.compile`` with the option on raises. Every rank must set the same."""
    setattr(model, EXACT_PARAMETER_GRADIENTS, bool(enabled))


def _exact(model: nn.Module) -> bool:
    return getattr(model, EXACT_PARAMETER_GRADIENTS, False)


def check_layout(model: nn.Module) -> None:
    """Refuse a context-parallel layout no mode can run (ValueError with the reason): a Ulysses degree
    that does not divide the heads. Called by ``flowlock.patch`` and by every forward."""
    cp = context_parallel_config(model)
    if cp is not None:
        check_heads(model.config.num_attention_heads, cp.ulysses_degree, "MiniMax-H3's transformer blocks")


def unsupported_reason(model: nn.Module) -> str | None:
    """Why the strict path cannot serve ``model``'s context-parallel config, or None."""
    cp = context_parallel_config(model)
    if cp is not None and cp.ring_degree > 1:
        return (f"ring attention (ring_degree={cp.ring_degree}) merges per-chunk softmaxes by their LSE, which "
                "is not one process's bits; use ulysses_degree alone")
    return None


def _check_patch_order(model: nn.Module, strict_mark: str) -> None:
    for name in ("transformer_blocks.0", "norm_out", "proj_out", "audio_proj_out"):
        forward = model.get_submodule(name).forward
        if not (isinstance(forward, types.MethodType) and getattr(forward.__func__, strict_mark, False)):
            raise RuntimeError(f"{name}.forward is wrapped by diffusers' context-parallel hooks over flowlock's: "
                               "enable_parallelism ran after flowlock.patch. Remove the patch, enable "
                               "parallelism, then patch")


def _check_fsdp_mesh(model: nn.Module, group) -> None:
    # The row-sharded parameters' per-rank gradients are partial and the others whole, so an FSDP2
    # mesh that also spans the Ulysses peers would average the two kinds alike: wrong gradients.
    peers = set(torch.distributed.get_process_group_ranks(group)) - {torch.distributed.get_rank()}
    meshes = {id(p.device_mesh): p.device_mesh for p in model.parameters() if hasattr(p, "device_mesh")}
    for mesh in meshes.values():
        shared = peers & set(mesh.mesh.flatten().tolist())
        if shared:
            raise ValueError(f"an FSDP2 mesh {tuple(mesh.mesh_dim_names or ())} spans Ulysses peers "
                             f"{sorted(shared)} of rank {torch.distributed.get_rank()}: shard over the data-parallel "
                             "mesh dimension only (gradients of row-sharded parameters are per-rank partials, "
                             "reduced by flowlock.models.minimax_h3.context_parallel.reduce_gradients)")


def _layout_fingerprint(structure: list[torch.Tensor]) -> int:
    # An int64 weighted sum of every structural value (wrapping on overflow, the same on every device):
    # ranks holding different packed layouts of the same length disagree on it.
    total = 0
    for t in structure:
        flat = t.reshape(-1).to(torch.int64)
        weights = torch.arange(1, flat.numel() + 1, dtype=torch.int64, device=flat.device) * 2654435761
        total = (total * 1000003 + int((flat + 1).mul(weights).sum().item())) % (1 << 62)
    return total


def sequence_plan(model: nn.Module, structure: list[torch.Tensor], batch: int, strict_mark: str
                  ) -> UlyssesSequence | None:
    """The Ulysses shards of one forward of ``model``, or None without context parallelism or on a
    Ulysses group of one rank (the plain forward).

    ``structure``: the forward's validated structural tensors (``position_ids`` (S, 3) first, then the
    per-row and row-index tensors). Every rank of the group must call it: it checks across the group
    that all ranks hold the same S, batch, model widths and layout (a fingerprint of ``structure``,
    memoized while those tensors are unchanged), and raises ValueError on every rank if not.
    """
    cp = context_parallel_config(model)
    if cp is None:
        return None
    check_layout(model)
    _check_patch_order(model, strict_mark)
    group = cp._ulysses_mesh.get_group()
    _check_fsdp_mesh(model, group)
    if group.size() == 1:
        # One rank holds every row: the plain strict forward, with no shard copies, no all-to-all and
        # no cross-rank layout check (each cost time at degree 1 and none can change a bit).
        return None
    fingerprint = memoized_over(structure, "ulysses_layout_fingerprint", lambda: _layout_fingerprint(structure))
    contract = (batch, model.config.num_attention_heads, model.config.hidden_size, len(model.transformer_blocks),
                fingerprint)
    seq_len, device = structure[0].shape[0], structure[0].device
    exact = _exact(model)
    if exact and torch.compiler.is_compiling():
        raise RuntimeError("exact parameter gradients under Ulysses gather rows inside the backward, which "
                           "torch.compile does not trace: run the model eagerly, or turn the option off")
    return Ulysses(group).for_sequence(seq_len, contract, device=device, exact_parameter_gradients=exact)


def row_sharded_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` of the parameters whose gradient each rank holds only for its own rows."""
    return [(n, p) for n, p in model.named_parameters() if n.startswith(ROW_SHARDED)]


def reduce_gradients(model: nn.Module) -> None:
    """After backward under Ulysses: replace the gradients of :func:`row_sharded_parameters` by their
    sum over the Ulysses group, folded in rank order (:func:`flowlock.parallel.fold_sum_`), so every
    rank of the group holds the same, repeatable bits. The other gradients are already whole on every
    rank and are left alone. Under :func:`exact_parameter_gradients` every gradient is already one
    process's: nothing to do. Under FSDP2 on the data-parallel mesh dimension call it after backward
    (FSDP2 has reduced over data-parallel ranks); gradients stay sharded. No-op without CP and on a
    group of one rank."""
    cp = context_parallel_config(model)
    if cp is None:
        return
    group = cp._ulysses_mesh.get_group()
    if group.size() == 1 or _exact(model):
        return
    grads = [p.grad for _, p in row_sharded_parameters(model) if p.grad is not None]
    fold_sum_(grads, group)
