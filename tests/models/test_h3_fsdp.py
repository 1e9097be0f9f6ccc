"""The strict path under FSDP2: two gloo ranks in subprocesses shard the tiny H3 the way a trainer
must (every block, norm_out, and each FP32 module as its own unit, since FSDP2 wants one dtype per
unit); each rank's strict outputs must be the unsharded strict outputs, bit for bit. As data
parallelism (rank r trains sample r): each rank's outputs and latent gradients are the unsharded
model's for that sample, bit for bit, and the reduce-scattered parameter gradients repeat bitwise."""

import os
import subprocess
import sys
import textwrap

from flowlock.parallel.ports import free_local_port

_WORKER = textwrap.dedent("""
    import os
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    import flowlock
    from flowlock.models.minimax_h3 import tiny_h3, tiny_inputs
    from flowlock.parallel.teardown import end_process_groups
    from flowlock.testing import assert_bitwise_equal

    LATENTS = ("hidden_states", "audio_hidden_states", "encoder_hidden_states")

    def forward_backward(model, inputs, rows):
        # Cotangents drawn for the whole batch and sliced like it: a sample's cotangent is its own.
        model.zero_grad(set_to_none=True)
        inputs = {k: (v[rows].clone().requires_grad_() if k in LATENTS else v) for k, v in inputs.items()}
        out = model(**inputs)
        gen = torch.Generator().manual_seed(5)
        outs = (out.sample, out.audio_sample)
        cot = [torch.randn((2, *t.shape[1:]), generator=gen)[rows].to(t.dtype) for t in outs]
        torch.autograd.backward(list(outs), cot)
        grads = {n: p.grad.to_local().clone() if hasattr(p.grad, "to_local") else p.grad.clone()
                 for n, p in model.named_parameters()}
        return (*(t.detach() for t in outs), *(inputs[k].grad for k in LATENTS)), grads

    dist.init_process_group("gloo")

    def run():
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        inputs = tiny_inputs(2)
        reference = tiny_h3()
        with flowlock.patch(reference):
            expected = reference(**inputs)
        model = tiny_h3()
        for module in [*model.token_refiner.refiner_blocks, *model.transformer_blocks, model.norm_out]:
            fully_shard(module, mesh=mesh)
        for name in ("proj_in", "audio_proj_in", "time_embedder", "proj_out", "audio_proj_out"):
            fully_shard(model.get_submodule(name), mesh=mesh)
        fully_shard(model, mesh=mesh)
        with flowlock.patch(model), flowlock.mode("strict") as frame:
            out = model(**inputs)
            (out.sample.square().sum() + out.audio_sample.sum()).backward()
        assert ("attention", "reference") in frame.ran
        assert_bitwise_equal((out.sample, out.audio_sample), (expected.sample, expected.audio_sample), "fsdp rank")
        assert all(p.grad is not None for p in model.parameters())

        rank = dist.get_rank()
        with flowlock.patch(reference):
            alone, _ = forward_backward(reference, inputs, slice(None))
        with flowlock.patch(model), flowlock.mode("strict"):
            first, grads = forward_backward(model, inputs, slice(rank, rank + 1))
            _, again = forward_backward(model, inputs, slice(rank, rank + 1))
        assert_bitwise_equal(first, tuple(t[rank:rank + 1] for t in alone), "dp rank outputs and latent gradients")
        assert len(grads) == len(list(model.parameters()))
        assert_bitwise_equal(list(again.values()), list(grads.values()), "dp rank parameter gradients repeat")

    run()
    end_process_groups()
    print("rank", os.environ["RANK"], "ok")
""")




def test_fsdp2_sharded_strict_forward_backward_equals_unsharded():
    world = 2
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_local_port()), WORLD_SIZE=str(world))
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER], env=dict(env, RANK=str(rank)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(world)]
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    for rank, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank} failed:\n{out[-3000:]}"
        assert f"rank {rank} ok" in out
