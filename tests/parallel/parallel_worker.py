"""One rank of a gloo job started by ``parallel_launch.launch``: ``python parallel_worker.py SCENARIO``.

Each scenario asserts as it goes (a failure exits non-zero with the traceback) and ends by printing
``rank <r> ok``. Allocations are poisoned as in the in-process tests. Single-process references are
computed on every rank from the same seeded weights and inputs.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from diffusers import ContextParallelConfig
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import flowlock
import flowlock.models.minimax_h3.context_parallel as h3_cp
import flowlock.models.minimax_h3.strict as h3_strict
from flowlock.models.minimax_h3 import TINY_H3_CONFIG, build_layout, make_h3, tiny_h3, tiny_inputs
from flowlock.parallel import CollectiveError
from flowlock.testing import assert_bitwise_equal, mismatch_count, poison_

LATENTS = ("hidden_states", "audio_hidden_states", "encoder_hidden_states")
BATCH = 2
FOUR_HEADS = dict(TINY_H3_CONFIG, num_attention_heads=4)
# S = 24 (a multiple of 2 and 4), 25 (of neither), 3 (fewer rows than 4 ranks: a zero-row shard).
LAYOUTS = (build_layout(5, 2, 2, 3, 7), build_layout(5, 2, 2, 3, 8), build_layout(1, 1, 1, 1, 1))


def _poison_allocations() -> None:
    for name in ("empty", "empty_like", "empty_strided"):
        original = getattr(torch, name)

        def poisoned(*args, __original=original, **kwargs):
            return poison_(__original(*args, **kwargs))

        setattr(torch, name, poisoned)


def _init() -> int:
    # diffusers' enable_parallelism puts rank r on accelerator r % torch.accelerator.device_count(),
    # a ZeroDivisionError on a CPU-only machine; these ranks all use the one CPU "device".
    if torch.accelerator.device_count() == 0:
        torch.accelerator.device_count = lambda: 1
    _poison_allocations()
    timeout = datetime.timedelta(seconds=float(os.environ["FLOWLOCK_PG_TIMEOUT"]))
    dist.init_process_group("gloo", timeout=timeout)
    return dist.get_rank()


def model_for(degree: int):
    """The tiny H3 (2 heads) for degree <= 2, the same with 4 heads for degree 4."""
    return tiny_h3() if degree <= 2 else make_h3(FOUR_HEADS)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


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
    grads = {n: _local(p.grad).detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return (out.sample.detach(), out.audio_sample.detach(), *(inputs[k].grad for k in LATENTS)), grads


def cp_model(degree: int, base=None, **config):
    """``base`` (default: :func:`model_for`) under diffusers' ``enable_parallelism`` with Ulysses ``degree``."""
    model = base if base is not None else model_for(degree)
    model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=degree, **config))
    return model


def rank_order_fold(tensors: dict, group) -> dict:
    """The fold contract, written out: all ranks' values, summed left in rank order in fp32, rounded once."""
    folded = {}
    for name, t in tensors.items():
        parts = [torch.zeros_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        acc = parts[0].float().clone()
        for part in parts[1:]:
            acc += part.float()
        folded[name] = acc.to(t.dtype)
    return folded


def reduce_and_check(model, grads: dict, sharded: set, what: str) -> dict:
    """Reduce ``model``'s row-sharded gradients (``grads`` holds their per-rank partials); assert they
    are the rank-order fold of the partials (so the same on every rank); return them."""
    h3_cp.reduce_gradients(model)
    reduced = {n: _local(p.grad).clone() for n, p in model.named_parameters() if n in sharded}
    spec = rank_order_fold({n: grads[n] for n in reduced}, h3_cp.context_parallel_config(model)._ulysses_mesh.get_group())
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
    assert_bitwise_equal([_local(p.grad) for n, p in model.named_parameters() if n in reduced],
                         list(reduced.values()), what + " repeated folded gradients")
    print(f"{what}: outputs and latent gradients equal one process, folded gradients repeat", flush=True)
    if rows == slice(None):
        # Not bitwise (each rank's partial is rounded to the parameter dtype before the fold): reported.
        worst = max((reduced[n].double() - ref_grads[n].double()).abs().max().item()
                    / max(ref_grads[n].double().abs().max().item(), 1e-30) for n in reduced)
        print(f"{what}: sharded-region gradients vs one process, max error / max |g| = {worst:.2e}", flush=True)
    return grads, ref_grads


def scenario_ulysses(rank: int) -> None:
    n = dist.get_world_size()
    ref, model = model_for(n), cp_model(n)
    sharded = {name for name, _ in h3_cp.row_sharded_parameters(model)}
    with flowlock.patch(ref), flowlock.patch(model):
        for layout in LAYOUTS:
            what = f"Ulysses {n}, S={layout.seq_len}, rank {rank}"
            inputs = tiny_inputs(BATCH, seed=1, layout=layout)
            grads, ref_grads = check_layout_equals_one_process(ref, model, inputs, slice(None), sharded, what)
            whole = sorted(set(grads) - sharded)
            assert whole and len(sharded) > len(whole)
            assert_bitwise_equal([grads[k] for k in whole], [ref_grads[k] for k in whole],
                                 what + " replicated-region parameter gradients")
        planted_row_count_gemm(ref, model, rank)
        planted_naive_all_reduce(model, sharded, rank)
    if n == 2:
        refusals_two_ranks(rank)
    else:
        refused = False
        try:
            flowlock.patch(cp_model(n, base=tiny_h3()))
        except ValueError as err:
            refused = "does not divide the 2 heads" in str(err)
        assert refused, "a Ulysses degree that does not divide the heads must be refused at patch time"


def planted_row_count_gemm(ref, model, rank: int) -> None:
    """A linear whose reduction order depends on how many rows it is given (as a split-K heuristic for
    small M does): below 32 rows it sums the two halves of K separately. One process gives the blocks
    B·S rows, a Ulysses rank fewer; the same comparison must catch it on every rank."""
    real = h3_strict.linear

    def planted(x, weight, bias=None, **kwargs):
        if x.numel() // x.shape[-1] >= 32 or x.shape[-1] < 2:
            return real(x, weight, bias, **kwargs)
        half = x.shape[-1] // 2
        out = real(x[..., :half].contiguous(), weight[:, :half].contiguous())
        out = out + real(x[..., half:].contiguous(), weight[:, half:].contiguous())
        return out if bias is None else out + bias

    inputs = tiny_inputs(BATCH, seed=1, layout=LAYOUTS[1])
    h3_strict.linear = planted
    try:
        with torch.no_grad():
            expected, got = ref(**inputs), model(**inputs)
    finally:
        h3_strict.linear = real
    caught = mismatch_count(got.sample, expected.sample) + mismatch_count(got.audio_sample, expected.audio_sample)
    assert caught, "the planted row-count-dependent linear was not caught"
    print(f"rank {rank}: planted row-count-dependent linear caught ({caught} output elements differ)", flush=True)


def planted_naive_all_reduce(model, sharded: set, rank: int) -> None:
    """Replace the fixed fold by the backend's all-reduce; report whether the fold check catches it."""
    real = h3_cp.fold_sum_

    def naive(grads, group):
        for g in grads:
            dist.all_reduce(_local(g), group=group)

    inputs = tiny_inputs(BATCH, seed=1, layout=LAYOUTS[1])
    _, grads = forward_backward(model, inputs)
    h3_cp.fold_sum_ = naive
    try:
        reduce_and_check(model, grads, sharded, "planted")
        caught = False
    except AssertionError:
        caught = True
    finally:
        h3_cp.fold_sum_ = real
    print(f"rank {rank}: planted naive all-reduce of bf16/fp32 partials over {dist.get_world_size()} ranks "
          f"{'caught' if caught else 'NOT caught (bitwise equal to the fold here)'}", flush=True)
    if dist.get_world_size() >= 4:
        assert caught, "the planted naive all-reduce was not caught"


def refusals_two_ranks(rank: int) -> None:
    inputs = tiny_inputs(BATCH, seed=1)
    ring = tiny_h3()
    ring.enable_parallelism(config=ContextParallelConfig(ring_degree=2))
    with flowlock.patch(ring):
        try:
            ring(**inputs)
            raise AssertionError("ring attention ran on the strict path")
        except flowlock.StrictModeError as err:
            assert "ring attention" in str(err), err
    late = tiny_h3()
    flowlock.patch(late)
    late.enable_parallelism(config=ContextParallelConfig(ulysses_degree=2))
    try:
        late(**inputs)
        raise AssertionError("hooks over the patch were not refused")
    except RuntimeError as err:
        assert "enable_parallelism ran after flowlock.patch" in str(err), err
    mismatch = cp_model(2)
    with flowlock.patch(mismatch):
        try:
            mismatch(**tiny_inputs(BATCH, seed=1, layout=LAYOUTS[rank]))
            raise AssertionError("ranks with different layouts were not refused")
        except ValueError as err:
            assert "disagree on the layout" in str(err), err
    print(f"rank {rank}: ring, patch order and a per-rank layout mismatch refused", flush=True)


def scenario_fsdp_ulysses(rank: int) -> None:
    """FSDP2 over the data-parallel dimension of a (dp 2, ring 1, ulysses 2) mesh, Ulysses over the last;
    the two data-parallel groups run different samples."""
    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("dp", "ring", "ulysses"))
    dp = mesh["dp"].get_local_rank()
    ref = model_for(2)
    model = cp_model(2, mesh=mesh)
    sharded = {name for name, _ in h3_cp.row_sharded_parameters(model)}
    for module in [*model.token_refiner.refiner_blocks, *model.transformer_blocks, model.norm_out]:
        fully_shard(module, mesh=mesh["dp"])
    for name in ("proj_in", "audio_proj_in", "time_embedder", "proj_out", "audio_proj_out"):
        fully_shard(model.get_submodule(name), mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    with flowlock.patch(ref), flowlock.patch(model):
        for layout in LAYOUTS[:2]:
            what = f"FSDP2 dp 2 x Ulysses 2, S={layout.seq_len}, rank {rank}"
            check_layout_equals_one_process(ref, model, tiny_inputs(BATCH, seed=1, layout=layout),
                                            slice(dp, dp + 1), sharded, what)


def _faulty(rank: int, fault) -> None:
    model = cp_model(dist.get_world_size())
    if rank == 1:
        model.transformer_blocks[1].register_forward_pre_hook(lambda module, args: fault())
    start = time.monotonic()
    with flowlock.patch(model):
        try:
            forward_backward(model, tiny_inputs(BATCH, seed=1))
        except CollectiveError as err:
            print(f"rank {rank}: CollectiveError after {time.monotonic() - start:.1f} s: {err}", flush=True)
            raise
    raise AssertionError("the forward finished although a rank failed")


def scenario_killed_rank(rank: int) -> None:
    _faulty(rank, lambda: os.kill(os.getpid(), signal.SIGKILL))


def scenario_failing_rank(rank: int) -> None:
    def fail():
        raise RuntimeError("planted failure on rank 1")
    _faulty(rank, fail)


def scenario_stuck_rank(rank: int) -> None:
    _faulty(rank, lambda: time.sleep(float(os.environ["FLOWLOCK_STUCK_S"])))


def main() -> None:
    rank = _init()
    globals()["scenario_" + sys.argv[1]](rank)
    dist.destroy_process_group()
    print(f"rank {rank} ok", flush=True)


if __name__ == "__main__":
    main()
