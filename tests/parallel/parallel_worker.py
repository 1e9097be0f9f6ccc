"""One rank of a gloo test job: ``python parallel_worker.py SCENARIO`` (started by ``parallel_launch``).

The layout checks themselves are ``flowlock check --layout``'s (:mod:`flowlock.validate.layout_worker`);
here they run with poisoned allocations, followed by what only tests do: planted non-invariant
pieces that the same checks must catch, refusals, and ranks that die, raise or stop responding.
Each scenario asserts as it goes (a failure exits non-zero with the traceback) and ends by printing
``rank <r> ok``.
"""

from __future__ import annotations

import contextlib
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
from flowlock.models.minimax_h3 import TINY_H3_CONFIG, build_packing, tiny_h3, tiny_inputs
from flowlock.ops import final_adaln_out, gate_residual, linear, linear_weight_grad, qk_norm_rope, rms_norm_modulate
from flowlock.parallel import CollectiveError
from flowlock.parallel.teardown import end_process_groups
from flowlock.testing import assert_bitwise_equal, mismatch_count, poison_
from flowlock.validate.layout_models import BATCH, PACKINGS, cp_model, local, model_for
from flowlock.validate.layout_worker import (
    check_fsdp_ulysses,
    check_ulysses,
    check_ulysses_exact,
    forward_backward,
    init,
    reduce_and_check,
    trace_layout,
)


def _poison_allocations() -> None:
    for name in ("empty", "empty_like", "empty_strided"):
        original = getattr(torch, name)

        def poisoned(*args, __original=original, **kwargs):
            return poison_(__original(*args, **kwargs))

        setattr(torch, name, poisoned)


def scenario_ulysses(rank: int) -> None:
    def plants(ref, model, sharded):
        planted_row_count_gemm(ref, model, rank)
        planted_naive_all_reduce(model, sharded, rank)
        if dist.get_world_size() == 2:
            checkpointed_blocks(ref, rank)

    check_ulysses(rank, plants)
    n = dist.get_world_size()
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

    inputs = tiny_inputs(BATCH, seed=1, packing=PACKINGS[1])
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
            dist.all_reduce(local(g), group=group)

    inputs = tiny_inputs(BATCH, seed=1, packing=PACKINGS[1])
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
    # Same S = 24 on both ranks, different packings: only the layout fingerprint tells them apart.
    packing = build_packing(5, 2, 2, 3, 7) if rank == 0 else build_packing(4, 2, 2, 3, 8)
    with flowlock.patch(mismatch):
        try:
            mismatch(**tiny_inputs(BATCH, seed=1, packing=packing))
            raise AssertionError("ranks with different layouts were not refused")
        except ValueError as err:
            assert "disagree on the layout" in str(err), err
    print(f"rank {rank}: ring, patch order and a per-rank layout mismatch refused", flush=True)


def checkpointed_blocks(ref, rank: int) -> None:
    """diffusers' gradient checkpointing recomputes each block, its all-to-alls included, in backward."""
    model = cp_model(2)
    model.enable_gradient_checkpointing()
    inputs = tiny_inputs(BATCH, seed=1, packing=PACKINGS[1])
    expected, _ = forward_backward(ref, inputs)
    with flowlock.patch(model):
        got, _ = forward_backward(model, inputs)
    assert_bitwise_equal(got, expected, f"checkpointed Ulysses 2, rank {rank}")
    print(f"rank {rank}: gradient-checkpointed blocks equal one process", flush=True)


def scenario_ulysses_exact(rank: int) -> None:
    check_ulysses_exact(rank)
    check_ulysses_exact_lora(rank)


def _with_lora(model):
    """``model`` with a rank-4 peft LoRA on the block linears, factors redrawn from one seed."""
    from peft import LoraConfig

    from flowlock.models.common.peft_lora import is_peft_lora

    model.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0", "ff.net.2"],
                                 init_lora_weights="gaussian"))
    gen = torch.Generator().manual_seed(11)
    for module in model.modules():
        if is_peft_lora(module):
            for factor in (module.lora_A["default"], module.lora_B["default"]):
                factor.weight.data = (torch.randn(factor.weight.shape, generator=gen) * 0.1).to(torch.bfloat16)
    return model


def check_ulysses_exact_lora(rank: int) -> None:
    """LoRA factors in the sharded region under exact parameter gradients: outputs, latent gradients
    and every factor's gradient bitwise one process's (the base weights are frozen by add_adapter)."""
    n = dist.get_world_size()
    ref, model = _with_lora(model_for(n)), cp_model(n, base=_with_lora(model_for(n)))
    h3_cp.exact_parameter_gradients(model)
    with flowlock.patch(ref), flowlock.patch(model):
        for packing in PACKINGS[1:]:
            what = f"Ulysses {n} exact with LoRA, S={packing.seq_len}, rank {rank}"
            inputs = tiny_inputs(BATCH, seed=1, packing=packing)
            expected, ref_grads = forward_backward(ref, inputs)
            with flowlock.mode("strict") as frame:
                got, grads = forward_backward(model, inputs)
            assert frame.fallbacks == [], frame.fallbacks
            assert_bitwise_equal(got, expected, what + " outputs and latent gradients")
            names = sorted(ref_grads)
            assert names == sorted(grads) and all("lora_" in k for k in names) and names, names
            assert_bitwise_equal([grads[k] for k in names], [ref_grads[k] for k in names], what + " LoRA gradients")
            print(f"{what}: all {len(names)} LoRA factor gradients equal one process", flush=True)
        h3_cp.exact_parameter_gradients(model, False)
        inputs = tiny_inputs(BATCH, seed=1, packing=PACKINGS[1])
        _, ref_grads = forward_backward(ref, inputs)
        _, grads = forward_backward(model, inputs)
        h3_cp.reduce_gradients(model)
        folded = {n: local(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        differ = [k for k in ref_grads if not torch.equal(folded[k], ref_grads[k])]
        assert differ, "the default fold gave one process's LoRA gradients: the check cannot tell them apart"
        print(f"rank {rank}: the default fold differs from one process in {len(differ)} LoRA factor gradients",
              flush=True)


def _exact_op_cases(seq: int):
    """(name, op, rows [(tensor, dim)], replicated, out_dim, rep_grads) for every op the exact Ulysses
    path wraps, with inputs drawn from one seed (the same full tensors on every rank)."""
    gen = torch.Generator().manual_seed(11)

    def rnd(*shape, dtype=torch.bfloat16, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    h, heads, d, tables, e = 32, 2, 16, 6, 24
    index = torch.randint(0, tables, (seq,), generator=gen)
    ti = torch.randint(0, 2, (seq,), generator=gen)
    cos, sin = rnd(seq, d, dtype=torch.float32), rnd(seq, d, dtype=torch.float32)

    def linear_grads(rows_all, dout_all, replicated, needs):
        return list(linear_weight_grad(rows_all[0], dout_all, *replicated))

    return [
        ("linear", linear, [(rnd(1, seq, h), 1)], [rnd(48, h, scale=0.2), rnd(48, scale=0.2)], 1, linear_grads),
        ("rms_norm_modulate", lambda x, i, w, sh, sc: rms_norm_modulate(x, w, sh, sc, i, 1e-6),
         [(rnd(1, seq, h), 1), (index, 0)], [rnd(h), rnd(tables, h, dtype=torch.float32, scale=0.1),
                                             rnd(tables, h, dtype=torch.float32, scale=0.1)], 1, None),
        ("gate_residual", lambda r, y, i, g: gate_residual(r, g, y, i), [(rnd(1, seq, h), 1), (rnd(1, seq, h), 1),
                                                                          (index, 0)],
         [rnd(tables, h, dtype=torch.float32)], 1, None),
        ("qk_norm_rope", lambda x, c, s_, w: qk_norm_rope(x, w, c, s_, 1e-6),
         [(rnd(1, seq, heads, d), 1), (cos, 0), (sin, 0)], [rnd(d)], 1, None),
        ("final_adaln_out", lambda x, i, t, nw, w, b: final_adaln_out(x, t, nw, w, b, i, 1e-6),
         [(rnd(1, seq, h), 1), (ti, 0)], [rnd(2, e, dtype=torch.float32), rnd(h), rnd(2 * h, e, scale=0.2),
                                          rnd(2 * h, scale=0.2)], 1, None),
    ]


def scenario_exact_ops(rank: int, backend: str) -> None:
    """Each op the exact Ulysses path wraps, on ``backend``: this rank's rows through
    ``exact_replicated_grads`` give the one-process output rows, row-input gradient rows and
    replicated-input gradients, bitwise."""
    from flowlock.parallel import Ulysses

    n = dist.get_world_size()
    for seq in (25, 3):
        sequence = Ulysses().for_sequence(seq, exact_parameter_gradients=True)
        start, end = sequence.shards.bounds()
        for name, op, rows, replicated, out_dim, rep_grads in _exact_op_cases(seq):
            what = f"{name} on {backend}, S={seq}, rank {rank}"
            with flowlock.use_backend(backend):
                full_rows = [t.clone().requires_grad_(t.dtype == torch.bfloat16) for t, _ in rows]
                full_reps = [r.clone().requires_grad_() for r in replicated]
                out = op(*full_rows, *full_reps)
                dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out.dtype)
                out.backward(dout)
                mine = [t.narrow(dim, start, end - start).clone().requires_grad_(t.dtype == torch.bfloat16)
                        for t, dim in rows]
                reps = [r.clone().requires_grad_() for r in replicated]
                with flowlock.mode("strict") as frame:
                    got = sequence.exact(op, [(t, dim) for t, (_, dim) in zip(mine, rows)], reps, out_dim, rep_grads)
                    got.backward(dout.narrow(out_dim, start, end - start))
            assert frame.ran and {b for _, b in frame.ran} == {backend}, (what, frame.ran)
            assert_bitwise_equal(got, out.narrow(out_dim, start, end - start), what + " output rows")
            for t, full, (_, dim) in zip(mine, full_rows, rows):
                if full.grad is not None:
                    assert_bitwise_equal(t.grad, full.grad.narrow(dim, start, end - start), what + " row gradients")
            assert_bitwise_equal([r.grad for r in reps], [r.grad for r in full_reps], what + " replicated gradients")
        print(f"rank {rank}: exact replicated gradients of every wrapped op equal one process on {backend}, "
              f"S={seq}, {n} ranks", flush=True)


def scenario_tree_reduce_scatter(rank: int, *node_sizes: str) -> None:
    """The hierarchical tree reduce-scatter for each node size gives the flat one's bits, which are the
    pairwise tree over rank order of every rank's block (fp32 and bf16 blocks, 37 elements)."""
    from flowlock.parallel import TreeReduceScatter, tree_sum
    from flowlock.parallel.exact_fsdp import node_groups

    n = dist.get_world_size()
    group = dist.group.WORLD
    hierarchical = {int(size): TreeReduceScatter(node_groups(group, int(size))) for size in node_sizes}
    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator().manual_seed(100 + rank)
        mine = (torch.randn(n * 37, generator=gen) * 10.0 ** torch.randint(-4, 5, (n * 37,), generator=gen)).to(dtype)
        every = [torch.empty_like(mine) for _ in range(n)]
        dist.all_gather(every, mine)
        spec = tree_sum([t.view(n, 37)[rank] for t in every]).to(dtype)
        flat = torch.empty(37, dtype=dtype)
        TreeReduceScatter()(flat, mine, group)
        assert_bitwise_equal(flat, spec, f"flat tree reduce-scatter, rank {rank}, {dtype}")
        running = every[0].view(n, 37)[rank].float().clone()
        for t in every[1:]:
            running += t.view(n, 37)[rank].float()
        assert not torch.equal(running.to(dtype), spec) or dtype == torch.bfloat16 or n < 3, \
            "a running sum gave the tree's bits: the blocks cannot tell the orders apart"
        for size, comm in hierarchical.items():
            out = torch.empty(37, dtype=dtype)
            comm(out, mine, group)
            assert_bitwise_equal(out, flat, f"nodes of {size}, rank {rank}, {dtype}")
    try:
        node_groups(group, 3)
        raise AssertionError("a node size of 3 was accepted")
    except ValueError as err:
        assert "power-of-two node size" in str(err), err
    half = dist.new_group(list(range(n // 2)))
    if rank < n // 2:
        try:
            node_groups(half, 1)
            raise AssertionError("a data-parallel group of half the job was accepted")
        except ValueError as err:
            assert "span the job" in str(err), err
    print(f"rank {rank}: hierarchical tree reduce-scatter (nodes of {', '.join(node_sizes)}) equals the flat tree "
          f"over {n} ranks", flush=True)


def scenario_fsdp_ulysses(rank: int) -> None:
    mesh = check_fsdp_ulysses(rank)
    across = cp_model(2, mesh=mesh)
    fully_shard(across.transformer_blocks[0], mesh=init_device_mesh("cpu", (4,)))
    with flowlock.patch(across):
        try:
            across(**tiny_inputs(BATCH, seed=1))
            raise AssertionError("an FSDP2 mesh spanning the Ulysses peers was not refused")
        except ValueError as err:
            assert "spans Ulysses peers" in str(err), err
    print(f"rank {rank}: an FSDP2 mesh spanning the Ulysses peers refused", flush=True)


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


@contextlib.contextmanager
def row_count_ffn_down_projection():
    """A planted fault for ``flowlock trace --layout``: the feed-forward down-projection (K = the
    FFN width) sums the two halves of K separately below 25 rows, as a small-M split-K heuristic
    would. At S = 25 one process gives the blocks 50 rows and Ulysses-2 ranks 26 and 24, so only
    rank 1's rows of ``transformer_blocks.0`` differ (after the block's attention, so rank 0's rows of
    that block are still exact); the refiner's 10 rows take the planted path in both layouts alike."""
    real = h3_strict.linear
    ffn = TINY_H3_CONFIG["ffn_dim"]

    def planted(x, weight, bias=None, **kwargs):
        if x.shape[-1] != ffn or x.numel() // x.shape[-1] >= 25:
            return real(x, weight, bias, **kwargs)
        half = x.shape[-1] // 2
        out = real(x[..., :half].contiguous(), weight[:, :half].contiguous())
        out = out + real(x[..., half:].contiguous(), weight[:, half:].contiguous())
        return out if bias is None else out + bias

    h3_strict.linear = planted
    try:
        yield
    finally:
        h3_strict.linear = real


def scenario_trace(rank: int, *args: str) -> None:
    """``flowlock trace --layout``'s rank program with this file's plants available."""
    trace_layout(rank, *args, plants={"ffn_rows": row_count_ffn_down_projection})


def _planted_failure(when: str, rank: int) -> None:
    """Raise on the rank that ``FLOWLOCK_PLANTED_FAILURE`` (``WHEN:RANK``, WHEN ``before_rendezvous`` or
    ``after_rendezvous``) names, at that point of any scenario: the job must end with that rank named."""
    if os.environ.get("FLOWLOCK_PLANTED_FAILURE") == f"{when}:{rank}":
        raise RuntimeError(f"planted failure on rank {rank} {when.replace('_', ' ')}")


def main() -> None:
    _poison_allocations()
    _planted_failure("before_rendezvous", int(os.environ["RANK"]))
    rank = init()
    _planted_failure("after_rendezvous", rank)
    globals()["scenario_" + sys.argv[1]](rank, *sys.argv[2:])
    end_process_groups()
    print(f"rank {rank} ok", flush=True)


if __name__ == "__main__":
    main()
