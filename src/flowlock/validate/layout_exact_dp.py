"""Exact data parallelism under FSDP2: every layout's step gradient is one process's bits (tiny H3, gloo).

A step is ``B`` micro-batches of one sample each (S = 25), sample ``i`` with its own cotangents. One
process runs them in order and folds their gradients with
:class:`~flowlock.parallel.sample_tree.MicroBatchGradients`; the data-parallel layouts run FSDP2 as
verl-omni does (blocks, refiner blocks, ``norm_out`` and the FP32 modules as units, fp32 master
parameters, bf16 compute, fp32 reduction) with :func:`~flowlock.parallel.exact_fsdp.exact_data_parallel`,
rank ``r`` on samples ``r, r + N, ...``. Checked, every parameter gradient ``torch.equal`` the
one-process fp32 tree sum:

* 2 ranks: FSDP2 DP 2, two micro-batches per rank (``B = 4``);
* 4 ranks: FSDP2 DP 4 (``B = 8``), flat and as two nodes of 2 ranks (the hierarchical tree), and
  DP 2 x Ulysses 2 with exact parameter gradients (``B = 4``);
  FSDP2's own reduction (the backend's reduce-scatter, sum, FSDP2's ``+=`` over micro-batches) on
  the same DP 4 step differs from one process, so the check can tell them apart; an HSDP mesh is refused.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import flowlock
import flowlock.models.minimax_h3.context_parallel as h3_cp
from flowlock.models.minimax_h3 import tiny_inputs
from flowlock.parallel import MicroBatchGradients, exact_data_parallel
from flowlock.parallel.collectives import full_tensor
from flowlock.testing import assert_bitwise_equal
from flowlock.validate.layout_models import LATENTS, PACKINGS, cp_model, model_for

MICRO_BATCHES_PER_RANK = 2
FP32_UNITS = ("proj_in", "audio_proj_in", "time_embedder", "proj_out", "audio_proj_out")
# Inputs stay as the model passes them: H3's blocks receive fp32 modulation tables.
BF16_COMPUTE = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
FP32_COMPUTE = MixedPrecisionPolicy(reduce_dtype=torch.float32, cast_forward_inputs=False)


def sample_backward(model, inputs: dict, i: int) -> None:
    """Forward and backward of sample ``i`` of ``inputs`` alone, with cotangents seeded by ``i``."""
    batch = {k: (v[i:i + 1].clone().requires_grad_() if k in LATENTS else v) for k, v in inputs.items()}
    out = model(**batch)
    gen = torch.Generator().manual_seed(1000 + i)
    outs = [out.sample, out.audio_sample]
    torch.autograd.backward(outs, [torch.randn(t.shape, generator=gen).to(t.device, t.dtype) for t in outs])


def one_process_trees(inputs: dict, counts: tuple[int, ...], ref=None) -> dict[int, dict[str, torch.Tensor]]:
    """{B: {name: the fp32 tree sum of samples 0 .. B-1's gradients}} from one process (``ref``: the
    model, default the tiny H3)."""
    ref = model_for(1) if ref is None else ref
    tree = MicroBatchGradients(ref.parameters())
    names = [n for n, p in ref.named_parameters() if p.requires_grad]
    totals = {}
    with flowlock.patch(ref), flowlock.mode("strict"):
        for i in range(max(counts)):
            sample_backward(ref, inputs, i)
            tree.add()
            if tree.count in counts:
                totals[tree.count] = dict(zip(names, tree.total()))
    return totals


def fsdp_with_fp32_masters(model, dp_mesh) -> None:
    """FSDP2 units as verl-omni wraps H3, on fp32 master copies of the bf16 parameters (exact)."""
    for p in model.parameters():
        if p.dtype == torch.bfloat16:
            p.data = p.data.float()
    for name in FP32_UNITS:
        fully_shard(model.get_submodule(name), mesh=dp_mesh, mp_policy=FP32_COMPUTE)
    for module in [*model.token_refiner.refiner_blocks, *model.transformer_blocks, model.norm_out]:
        fully_shard(module, mesh=dp_mesh, mp_policy=BF16_COMPUTE)
    fully_shard(model, mesh=dp_mesh, mp_policy=BF16_COMPUTE)


def micro_batch_step(model, inputs: dict, dp_rank: int, dp: int, micro_batches: int,
                     tree: MicroBatchGradients | None) -> None:
    """This rank's ``micro_batches`` samples ``k * dp + dp_rank``, one backward each, folded by ``tree``
    (written after the last) or, without one, left to FSDP2's own accumulation."""
    for k in range(micro_batches):
        sample_backward(model, inputs, k * dp + dp_rank)
        if tree is not None:
            tree.add()
    if tree is not None:
        tree.write_()


def data_parallel_step(model, inputs: dict, dp_rank: int, dp: int, exact: bool) -> dict[str, torch.Tensor]:
    """This rank's micro-batches ``k * dp + dp_rank``; {name: full fp32 gradient} after the step."""
    tree = MicroBatchGradients(model.parameters(), data_parallel_size=dp) if exact else None
    with flowlock.patch(model), flowlock.mode("strict"):
        micro_batch_step(model, inputs, dp_rank, dp, MICRO_BATCHES_PER_RANK, tree)
    return {n: full_tensor(p.grad) for n, p in model.named_parameters() if p.grad is not None}


def check_equal(got: dict, expected: dict, what: str) -> None:
    assert sorted(got) == sorted(expected), (what, sorted(set(got) ^ set(expected)))
    names = sorted(expected)
    assert_bitwise_equal([got[n] for n in names], [expected[n] for n in names], what + " parameter gradients")
    print(f"{what}: all {len(names)} parameter gradients equal one process", flush=True)


def check_exact_data_parallel(rank: int) -> None:
    """The scenarios of this module's docstring for the job's world size (2 or 4)."""
    n = dist.get_world_size()
    inputs = tiny_inputs(n * MICRO_BATCHES_PER_RANK, seed=1, packing=PACKINGS[1])
    counts = (n * MICRO_BATCHES_PER_RANK,) if n == 2 else (4, 8)
    expected = one_process_trees(inputs, counts)
    model = model_for(1)
    fsdp_with_fp32_masters(model, init_device_mesh("cpu", (n,), mesh_dim_names=("dp",)))
    assert exact_data_parallel(model) == n
    check_equal(data_parallel_step(model, inputs, rank, n, exact=True), expected[n * MICRO_BATCHES_PER_RANK],
                f"FSDP2 DP {n} exact, {MICRO_BATCHES_PER_RANK} micro-batches per rank, rank {rank}")
    if n == 4:
        nodes = model_for(1)
        fsdp_with_fp32_masters(nodes, init_device_mesh("cpu", (n,), mesh_dim_names=("dp",)))
        exact_data_parallel(nodes, node_size=2)
        check_equal(data_parallel_step(nodes, inputs, rank, n, exact=True), expected[8],
                    f"FSDP2 DP 4 exact, nodes of 2 (within, then across), rank {rank}")
        check_dp2_ulysses2(rank, inputs, expected[4])
        check_backend_reduction_differs(rank, inputs, expected[8])
        check_hsdp_refused(rank)


def check_dp2_ulysses2(rank: int, inputs: dict, expected: dict) -> None:
    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp", "ring", "ulysses"))
    model = cp_model(2, base=model_for(1), mesh=mesh)
    h3_cp.exact_parameter_gradients(model)
    fsdp_with_fp32_masters(model, mesh["dp"])
    exact_data_parallel(model)
    dp_rank = mesh["dp"].get_local_rank()
    check_equal(data_parallel_step(model, inputs, dp_rank, 2, exact=True), expected,
                f"FSDP2 DP 2 x Ulysses 2 exact, rank {rank}")


def check_backend_reduction_differs(rank: int, inputs: dict, expected: dict) -> None:
    model = model_for(1)
    fsdp_with_fp32_masters(model, init_device_mesh("cpu", (4,), mesh_dim_names=("dp",)))
    for unit in (m for m in model.modules() if hasattr(m, "set_gradient_divide_factor")):
        unit.set_force_sum_reduction_for_comms(True)
        unit.set_gradient_divide_factor(1.0)
    got = data_parallel_step(model, inputs, rank, 4, exact=False)
    differ = [k for k in expected if not torch.equal(got[k], expected[k])]
    assert differ, "FSDP2's own reduction gave one process's bits: the check cannot tell them apart"
    print(f"rank {rank}: FSDP2's own reduction differs from one process in {len(differ)} of {len(expected)} "
          "parameter gradients", flush=True)


def check_hsdp_refused(rank: int) -> None:
    model = model_for(1)
    fully_shard(model.transformer_blocks[0], mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "dp")))
    try:
        exact_data_parallel(model)
        raise AssertionError("exact_data_parallel accepted an HSDP mesh")
    except ValueError as err:
        assert "HSDP" in str(err), err
    print(f"rank {rank}: exact data parallelism on an HSDP mesh refused", flush=True)

