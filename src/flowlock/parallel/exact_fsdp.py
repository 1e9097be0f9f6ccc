"""FSDP2's gradient reduce-scatter as the fixed tree of :mod:`flowlock.parallel.sample_tree`.

FSDP2 sums the data-parallel ranks' gradients with the backend's reduce-scatter, whose order
depends on the algorithm and the number of ranks, and divides by ``N``. :func:`exact_data_parallel`
replaces that reduction on every FSDP2 unit of a module, through FSDP2's own
``set_custom_reduce_scatter``, by :class:`TreeReduceScatter`: an all-to-all gives each rank every
rank's values for its shard, which it sums in fp32 in the pairwise tree over rank order
(:func:`~flowlock.parallel.sample_tree.tree_sum`), rounded once to the reduce dtype; nothing is
divided (the sum is the contract; scale the loss, the same on every layout). With rank ``r`` on global
micro-batch ``k * N + r`` and :class:`~flowlock.parallel.sample_tree.MicroBatchGradients` folding the
micro-batches, the step's gradients are one process's bits for every power-of-two ``N``.

Cost: the all-to-all moves what a ring reduce-scatter moves (each rank sends ``(N - 1) / N`` of its
unsharded gradient), in one step rather than ``N - 1``, and the fold runs on FSDP2's reduce-scatter stream after
it; the received ``N`` shards are one extra unsharded gradient of memory per unit while it runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

# the interface set_custom_reduce_scatter documents; torch keeps it in a private module
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from flowlock.parallel.collectives import collective
from flowlock.parallel.sample_tree import tree_sum


class TreeReduceScatter(ReduceScatter):
    """A reduce-scatter (sum) whose result is the fp32 :func:`tree_sum` of the ranks' blocks in rank
    order, rounded once to the output dtype: the same bits on every backend and for every message size.

    ``nodes``: for a group spanning several nodes of ``L`` consecutive ranks each (``L`` a power of
    two), :func:`node_groups`' ``(node group, rail group)`` of this rank. The sum then runs in two
    steps, each one all-to-all: within the node (every rank's blocks for the destinations of this
    rank's local index, summed over the ``L`` local ranks), then across nodes over the rail of ranks
    with the same local index (the ``M`` node sums). The bits are the flat sum's: with ``L`` a power of
    two each node's ``L`` leaves are a subtree of the flat tree, and above them the flat tree is the
    same rule over the ``M`` node sums. Inter-node bytes per rank: ``(M - 1) / M`` of ``1 / L`` of the
    unsharded gradient (in fp32), against ``(N - 1) / N`` of all of it flat.
    """

    def __init__(self, nodes: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None):
        self.nodes = nodes

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(tuple(size), dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op=dist.ReduceOp.SUM, async_op: bool = False):
        if op != dist.ReduceOp.SUM:
            raise ValueError(f"flowlock's tree reduce-scatter sums; FSDP2 asked for {op} (exact_data_parallel sets "
                             "the divide factor to 1 and sum-only reductions)")
        n = group.size()
        if self.nodes is None:
            received = torch.empty_like(input_tensor).view(n, -1)
            with collective("FSDP2 gradient tree all-to-all", group):
                dist.all_to_all_single(received, input_tensor.view(n, -1), group=group)
            output_tensor.copy_(tree_sum(list(received)).view_as(output_tensor))
            return None
        node, rail = self.nodes
        local, across = node.size(), rail.size()
        # block d of the input is destination rank d = m * L + l: local rank l gets every node's l-blocks
        send = input_tensor.view(across, local, -1).transpose(0, 1).contiguous()
        received = torch.empty_like(send)
        with collective("FSDP2 gradient tree all-to-all within the node", node):
            dist.all_to_all_single(received, send, group=node)
        node_sums = tree_sum(list(received))  # (M, block) fp32: this node's sum for each rail peer
        gathered = torch.empty_like(node_sums)
        with collective("FSDP2 gradient tree all-to-all across nodes", rail):
            dist.all_to_all_single(gathered, node_sums, group=rail)
        output_tensor.copy_(tree_sum(list(gathered)).view_as(output_tensor))
        return None


def node_groups(group: dist.ProcessGroup, node_size: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """``(node group, rail group)`` of this rank for ``group`` split into nodes of ``node_size``
    consecutive ranks: its node's ranks, and the ranks of every node with its local index. Every rank of
    ``group`` must call it (it creates all of both families, in one global order). Refused: a node size
    that is not a power of two or does not divide the group, and a group that is not the whole job
    (every rank creates every group in one order, which a job of several data-parallel groups, e.g.
    beside Ulysses, would have to enumerate across all of them)."""
    n = group.size()
    if node_size < 1 or node_size & (node_size - 1) or n % node_size:
        raise ValueError(f"a hierarchical tree needs a power-of-two node size that divides the group: "
                         f"{node_size} ranks per node, {n} ranks")
    if n != dist.get_world_size():
        raise ValueError(f"a hierarchical tree needs the data-parallel group to span the job: {n} of "
                         f"{dist.get_world_size()} ranks")
    ranks = [dist.get_global_rank(group, r) for r in range(n)]
    nodes = [ranks[m:m + node_size] for m in range(0, n, node_size)]
    rails = [ranks[local::node_size] for local in range(node_size)]
    node, _ = dist.new_subgroups_by_enumeration(nodes)
    rail, _ = dist.new_subgroups_by_enumeration(rails)
    return node, rail


def _units(module: nn.Module) -> list[FSDPModule]:
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def exact_data_parallel(module: nn.Module, node_size: int | None = None) -> int:
    """Give every FSDP2 unit in ``module`` (after ``fully_shard``) the tree reduce-scatter, sum-only with
    divide factor 1; returns the data-parallel degree ``N`` (for
    :class:`~flowlock.parallel.sample_tree.MicroBatchGradients`). ``node_size``: ranks per node, for
    the two-step (within, then across nodes) tree with the flat tree's bits. Refused: no FSDP2 unit,
    units on different meshes, and a mesh of more than one dimension (HSDP's replicate all-reduce is
    the backend's own)."""
    units = _units(module)
    if not units:
        raise ValueError("exact_data_parallel: the module has no FSDP2 unit (call fully_shard first)")
    meshes = {p.device_mesh for p in module.parameters() if hasattr(p, "device_mesh")}
    if len(meshes) != 1:
        raise ValueError(f"exact_data_parallel: the FSDP2 units are on {len(meshes)} meshes; one 1-D mesh needed")
    mesh = next(iter(meshes))
    if mesh.ndim != 1:
        raise ValueError(f"exact_data_parallel: a {mesh.ndim}-D FSDP2 mesh {tuple(mesh.mesh_dim_names or ())} "
                         "(HSDP) reduces its replicas with the backend's all-reduce; shard over one dimension")
    comm = TreeReduceScatter(None if node_size is None else node_groups(mesh.get_group(), node_size))
    for unit in units:
        unit.set_custom_reduce_scatter(comm)
        unit.set_force_sum_reduction_for_comms(True)
        unit.set_gradient_divide_factor(1.0)
    return mesh.size()
