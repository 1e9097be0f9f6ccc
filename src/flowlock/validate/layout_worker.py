"""One rank of a ``flowlock check --layout`` / ``trace --layout`` job: ``python -m flowlock.validate.layout_worker
SCENARIO ARGS...``; :data:`flowlock.validate.layout_spec.PARALLEL_LAYOUTS` names each layout's scenario.

Scenarios (gloo, the tiny H3; every rank also computes the one-process reference from the same seeded
weights and inputs):

* ``ulysses``: diffusers' ``enable_parallelism(ContextParallelConfig(ulysses_degree=N))``, N = world, at
  S = 24, 25 and 3 (uneven and zero-row shards);
* ``fsdp_ulysses``: 4 ranks, FSDP2 over ``dp`` of a (dp 2, ring 1, ulysses 2) mesh, each data-parallel
  group on its own sample;
* ``exact_dp``: :mod:`flowlock.validate.layout_exact_dp`;
* ``trace``: one rank of a ``trace --layout`` job (:func:`trace_layout`).

The checks assert that every rank's outputs, latent gradients and the gradients outside the sharded
region are bitwise one process's, that the sharded region's gradients are the rank-order fold of the
per-rank partials, and that they repeat; a failure exits non-zero with the traceback, success prints
``rank <r> ok``. On a CPU-only machine the worker presents the CPU as one accelerator: diffusers'
``enable_parallelism`` places rank r on device ``r % torch.accelerator.device_count()``, which is a
ZeroDivisionError when the count is 0.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import flowlock
import flowlock.models.minimax_h3.context_parallel as h3_cp
from flowlock.models.minimax_h3 import tiny_inputs
from flowlock.parallel.collectives import gather_from_ranks
from flowlock.parallel.teardown import end_process_groups
from flowlock.testing import assert_bitwise_equal
from flowlock.validate.layout_exact_dp import check_exact_data_parallel
from flowlock.validate.layout_models import BATCH, LATENTS, PACKINGS, cp_model, local, model_for, traced_batch
from flowlock.validate.layout_spec import parse_parallel_layout


def init() -> int:
    """Join the gloo job described by the torch.distributed environment variables; return the rank.
    The process group times out after ``FLOWLOCK_PG_TIMEOUT`` seconds (default 60)."""
    if torch.accelerator.device_count() == 0:
        torch.accelerator.device_count = lambda: 1
    timeout = datetime.timedelta(seconds=float(os.environ.get("FLOWLOCK_PG_TIMEOUT", "60")))
    dist.init_process_group("gloo", timeout=timeout)
    return dist.get_rank()


def forward_backward(model, inputs: dict, rows: slice = slice(None), seed: int = 5):
    """Outputs and latent gradients of the samples ``rows`` of ``inputs`` (a batch of ``BATCH``), as a
    tuple of 5, and {name: this rank's parameter gradient}; cotangents are drawn for the whole batch
    and sliced the same way, so a sample's cotangent does not depend on which rank runs it."""
    model.zero_grad(set_to_none=True)
    inputs = {k: (v[rows].clone().requires_grad_() if k in LATENTS else v) for k, v in inputs.items()}
    out = model(**inputs)
    gen = torch.Generator().manual_seed(seed)
    outs = (out.sample, out.audio_sample)
    cot = [torch.randn((BATCH, *t.shape[1:]), generator=gen)[rows].to(t.dtype) for t in outs]
    torch.autograd.backward(list(outs), cot)
    grads = {n: local(p.grad).detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return (out.sample.detach(), out.audio_sample.detach(), *(inputs[k].grad for k in LATENTS)), grads


def rank_order_fold(tensors: dict, group) -> dict:
    """The fold contract, written out: all ranks' values, summed left in rank order in fp32, rounded once."""
    folded = {}
    for name, t in tensors.items():
        parts = gather_from_ranks(t, group)
        acc = parts[0].float().clone()
        for part in parts[1:]:
            acc += part.float()
        folded[name] = acc.to(t.dtype)
    return folded


def reduce_and_check(model, grads: dict, sharded: set, what: str) -> dict:
    """Reduce ``model``'s row-sharded gradients (``grads`` holds their per-rank partials); assert they
    are the rank-order fold of the partials (so the same on every rank); return them."""
    h3_cp.reduce_gradients(model)
    reduced = {n: local(p.grad).clone() for n, p in model.named_parameters() if n in sharded}
    group = h3_cp.context_parallel_config(model)._ulysses_mesh.get_group()
    spec = rank_order_fold({n: grads[n] for n in reduced}, group)
    assert_bitwise_equal(list(reduced.values()), list(spec.values()), what + " folded parameter gradients")
    return reduced


def check_layout_equals_one_process(ref, model, inputs, rows, sharded, what) -> tuple:
    """Forward + backward of ``model`` (patched, context parallel) on the samples ``rows``: outputs,
    latent gradients and the gradients of parameters outside the sharded region bitwise those of
    ``ref`` (one process, whole batch); sharded-region gradients folded and repeatable."""
    expected, ref_grads = forward_backward(ref, inputs)
    expected = tuple(t[rows] for t in expected)
    with flowlock.mode("strict") as frame:
        got, grads = forward_backward(model, inputs, rows)
    assert ("attention", "reference") in frame.ran, frame.ran
    assert_bitwise_equal(got, expected, what + " outputs and latent gradients")
    reduced = reduce_and_check(model, grads, sharded, what)
    _, again = forward_backward(model, inputs, rows)
    assert_bitwise_equal([again[n] for n in reduced], [grads[n] for n in reduced], what + " repeated partials")
    h3_cp.reduce_gradients(model)
    assert_bitwise_equal([local(p.grad) for n, p in model.named_parameters() if n in reduced],
                         list(reduced.values()), what + " repeated folded gradients")
    print(f"{what}: outputs and latent gradients equal one process, folded gradients repeat", flush=True)
    if rows == slice(None):
        # Not bitwise (each rank's partial is rounded to the parameter dtype before the fold): reported.
        worst = max((reduced[n].double() - ref_grads[n].double()).abs().max().item()
                    / max(ref_grads[n].double().abs().max().item(), 1e-30) for n in reduced)
        print(f"{what}: sharded-region gradients vs one process, max error / max |g| = {worst:.2e}", flush=True)
    return grads, ref_grads


def check_ulysses(rank: int, extra=None) -> None:
    """Ulysses N = world at every S of :data:`PACKINGS`; then ``extra(ref, model, sharded)`` while both
    models are still patched."""
    n = dist.get_world_size()
    ref, model = model_for(n), cp_model(n)
    sharded = {name for name, _ in h3_cp.row_sharded_parameters(model)}
    with flowlock.patch(ref), flowlock.patch(model):
        for packing in PACKINGS:
            what = f"Ulysses {n}, S={packing.seq_len}, rank {rank}"
            inputs = tiny_inputs(BATCH, seed=1, packing=packing)
            grads, ref_grads = check_layout_equals_one_process(ref, model, inputs, slice(None), sharded, what)
            whole = sorted(set(grads) - sharded)
            assert whole and len(sharded) > len(whole)
            assert_bitwise_equal([grads[k] for k in whole], [ref_grads[k] for k in whole],
                                 what + " replicated-region parameter gradients")
        if extra is not None:
            extra(ref, model, sharded)


def _all_grads(model) -> dict:
    return {n: local(p.grad).detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def check_ulysses_exact(rank: int) -> None:
    """Ulysses N = world under ``exact_parameter_gradients`` at every S of :data:`PACKINGS` and with
    gradient-checkpointed blocks: outputs, latent gradients and every parameter gradient (after the
    no-op ``reduce_gradients``) bitwise one process's. The same comparison finds the default rank-order
    fold differing from one process, so it can tell the two apart."""
    n = dist.get_world_size()
    ref, model, ckpt_ref, ckpt = model_for(n), cp_model(n), model_for(n), cp_model(n)
    for m in (ckpt_ref, ckpt):
        m.enable_gradient_checkpointing()
    for m in (model, ckpt):
        h3_cp.exact_parameter_gradients(m)
    cases = [(ref, model, packing, "") for packing in PACKINGS] + [(ckpt_ref, ckpt, PACKINGS[1], ", checkpointed")]
    with flowlock.patch(ref), flowlock.patch(model), flowlock.patch(ckpt_ref), flowlock.patch(ckpt):
        for one, layered, packing, how in cases:
            what = f"Ulysses {n} exact, S={packing.seq_len}{how}, rank {rank}"
            inputs = tiny_inputs(BATCH, seed=1, packing=packing)
            expected, ref_grads = forward_backward(one, inputs)
            with flowlock.mode("strict") as frame:
                got, _ = forward_backward(layered, inputs)
            assert ("attention", "reference") in frame.ran, frame.ran
            h3_cp.reduce_gradients(layered)
            grads = _all_grads(layered)
            assert_bitwise_equal(got, expected, what + " outputs and latent gradients")
            assert sorted(grads) == sorted(ref_grads), what
            names = sorted(ref_grads)
            assert_bitwise_equal([grads[k] for k in names], [ref_grads[k] for k in names],
                                 what + " parameter gradients")
            print(f"{what}: all {len(names)} parameter gradients equal one process", flush=True)
        h3_cp.exact_parameter_gradients(model, False)
        inputs = tiny_inputs(BATCH, seed=1, packing=PACKINGS[1])
        _, ref_grads = forward_backward(ref, inputs)
        forward_backward(model, inputs)
        h3_cp.reduce_gradients(model)
        folded = _all_grads(model)
        differ = [k for k in ref_grads if not torch.equal(folded[k], ref_grads[k])]
        assert differ, "the default rank-order fold gave one process's bits: the check cannot tell them apart"
        print(f"rank {rank}: the default fold differs from one process in {len(differ)} parameter gradients",
              flush=True)
        # an audit-mode fallback (an active dropout: its module runs its own forward) would leave its
        # parameters' gradients partial: refused, before any collective
        h3_cp.exact_parameter_gradients(model)
        dropout = model.transformer_blocks[0].ff.net[1]
        dropout.p, training = 0.1, dropout.training
        dropout.train()
        try:
            with flowlock.mode("audit"):
                model(**inputs)
            raise AssertionError("an audit fallback under exact parameter gradients was not refused")
        except flowlock.StrictModeError as err:
            assert "transformer_blocks.0.ff" in str(err), err
        finally:
            dropout.p = 0.0
            dropout.train(training)
        print(f"rank {rank}: an audit fallback under exact parameter gradients refused", flush=True)


def shard_over_dp(model, dp_mesh) -> None:
    """FSDP2 units as verl-omni wraps H3 (blocks and refiner blocks), plus ``norm_out`` and the FP32
    modules as units of their own (FSDP2 wants one dtype per unit), then the root; on ``dp_mesh``."""
    for module in [*model.token_refiner.refiner_blocks, *model.transformer_blocks, model.norm_out]:
        fully_shard(module, mesh=dp_mesh)
    for name in ("proj_in", "audio_proj_in", "time_embedder", "proj_out", "audio_proj_out"):
        fully_shard(model.get_submodule(name), mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)


def check_fsdp_ulysses(rank: int):
    """FSDP2 dp 2 x Ulysses 2 on 4 ranks at S = 24 and 25; returns the (dp, ring, ulysses) mesh."""
    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp", "ring", "ulysses"))
    dp = mesh["dp"].get_local_rank()
    ref = model_for(2)
    model = cp_model(2, mesh=mesh)
    sharded = {name for name, _ in h3_cp.row_sharded_parameters(model)}
    shard_over_dp(model, mesh["dp"])
    with flowlock.patch(ref), flowlock.patch(model):
        for packing in PACKINGS[:2]:
            what = f"FSDP2 dp 2 x Ulysses 2, S={packing.seq_len}, rank {rank}"
            check_layout_equals_one_process(ref, model, tiny_inputs(BATCH, seed=1, packing=packing),
                                            slice(dp, dp + 1), sharded, what)
    return mesh


def trace_layout(rank: int, out_dir: str, spec: str, model_degree: str, *runs: str, plants: dict | None = None
                 ) -> None:
    """One rank of a ``flowlock trace --layout`` job under the parallel layout ``spec`` (a traced row of
    :data:`~flowlock.validate.layout_spec.PARALLEL_LAYOUTS`), ``model_degree`` picking the model
    (:func:`model_for`) so that both layouts of a trace hold the same weights.

    Each of ``runs`` (``MODE:SEQ_LEN[:PLANT]``) is one forward and backward of
    :func:`~flowlock.validate.layout_models.traced_batch` in ``MODE``, recording every module's output,
    the gradient of every module output (:func:`flowlock.validate.trace.capture_step`) and the latent
    input gradients; inside ``plants[PLANT]()`` (a context manager; tests plant faults this way) when
    named. Written with this rank's place in the layout to ``out_dir/rank<r>.pt``."""
    from flowlock.parallel import RowShards
    from flowlock.validate.trace import Record, capture_step

    layout = parse_parallel_layout(spec, "trace")
    dp, ulysses = layout.dp, layout.ulysses
    if dist.get_world_size() != layout.world:
        raise ValueError(f"layout {layout.name} needs {layout.world} ranks, the job has {dist.get_world_size()}")
    dp_rank, ulysses_rank = divmod(rank, ulysses)
    model = model_for(int(model_degree))
    mesh = init_device_mesh("cpu", (dp, 1, ulysses), mesh_dim_names=("dp", "ring", "ulysses")) if dp > 1 else None
    if ulysses > 1:
        cp_model(ulysses, base=model, **({} if mesh is None else {"mesh": mesh}))
    if dp > 1:
        shard_over_dp(model, mesh["dp"])
    per_dp = BATCH // dp
    rows = slice(dp_rank * per_dp, (dp_rank + 1) * per_dp)
    saved = {}
    for run in runs:
        mode, seq_len, *plant = run.split(":")
        inputs = traced_batch(int(seq_len))
        latent_grads = []

        def step(mode=mode, inputs=inputs, latent_grads=latent_grads):
            with flowlock.mode(mode):
                latent_grads.extend(forward_backward(model, inputs, rows)[0][2:])

        with contextlib.ExitStack() as stack:
            if plant:
                stack.enter_context(plants[plant[0]]())
            stack.enter_context(flowlock.patch(model))
            forward, backward = capture_step(model, step)
        backward += [Record(f"<input {name}>", (g,)) for name, g in zip(LATENTS, latent_grads)]
        meta = dict(rank=rank, world=layout.world, dp=dp, ulysses=ulysses, dp_rank=dp_rank,
                    ulysses_rank=ulysses_rank, seq_len=int(seq_len), batch=BATCH, batch_start=rows.start,
                    local_batch=per_dp, rows=list(RowShards(int(seq_len), ulysses, ulysses_rank).bounds()))
        saved[run] = {"meta": meta, **{phase: [(r.name, list(r.outputs)) for r in records]
                                       for phase, records in (("forward", forward), ("backward", backward))}}
        print(f"rank {rank}: traced {run}", flush=True)
    torch.save(saved, os.path.join(out_dir, f"rank{rank}.pt"))


SCENARIOS = {"ulysses": check_ulysses, "fsdp_ulysses": check_fsdp_ulysses, "exact_dp": check_exact_data_parallel,
             "trace": trace_layout}


def main() -> None:
    rank = init()
    SCENARIOS[sys.argv[1]](rank, *sys.argv[2:])
    end_process_groups()
    print(f"rank {rank} ok", flush=True)


if __name__ == "__main__":
    main()
