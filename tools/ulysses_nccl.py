"""Ulysses N on NCCL GPUs: every rank's outputs and latent gradients against one GPU, full-width H3.

    torchrun --nproc-per-node 2 tools/ulysses_nccl.py --layers 2 --seq 4097 --out ulysses_nccl_2.json

Each rank builds the same seeded full-width H3 twice (one plain, one under diffusers'
``enable_parallelism(ContextParallelConfig(ulysses_degree=N))``), both under ``flowlock.patch``, runs
forward and backward with the same cotangents, and counts mismatching elements (``torch.equal``
semantics) of the outputs and latent gradients; it also times both forward+backward passes (CUDA
events, median of ``--repeats`` after one warm-up), then the same two models unpatched (stock
diffusers Ulysses and one GPU; what stock refuses, such as an uneven S, is recorded as its error). Rank 0
writes the JSON report. N must divide 56. ``--tiny`` runs the tiny H3 on CPU and gloo (the CPU test,
``tests/benchmarks/test_ulysses_nccl_script.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import harness  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist
from diffusers import ContextParallelConfig

import flowlock
from flowlock.models.minimax_h3 import TINY_H3_CONFIG, full_width_config, make_h3, packing_for_length, tiny_inputs
from flowlock.parallel.teardown import end_process_groups
from flowlock.testing import mismatch_count

LATENTS = ("hidden_states", "audio_hidden_states", "encoder_hidden_states")


def forward_backward(model, inputs, cotangent_seed=5):
    model.zero_grad(set_to_none=True)
    inputs = {k: (v.clone().requires_grad_() if k in LATENTS else v) for k, v in inputs.items()}
    out = model(**inputs)
    gen = torch.Generator().manual_seed(cotangent_seed)
    outs = (out.sample, out.audio_sample)
    cot = [torch.randn(t.shape, generator=gen).to(device=t.device, dtype=t.dtype) for t in outs]
    torch.autograd.backward(list(outs), cot)
    return (*(t.detach() for t in outs), *(inputs[k].grad for k in LATENTS))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4097)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="ulysses_nccl.json")
    parser.add_argument("--tiny", action="store_true", help="the tiny H3 on CPU and gloo (the script's CPU test)")
    args = parser.parse_args(argv)
    if args.tiny:
        # diffusers' enable_parallelism places rank r on device r % device_count(): none on a CPU host
        torch.accelerator.device_count = lambda: 1
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.tiny:
        device = torch.device("cpu")
        config = TINY_H3_CONFIG
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
        config = full_width_config(num_layers=args.layers, num_refiner_layers=1)
    ref = make_h3(config, device=device, draw_on_device=not args.tiny)
    model = make_h3(config, device=device, draw_on_device=not args.tiny)
    model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
    inputs = tiny_inputs(1, config=config, packing=packing_for_length(args.seq), device=device)
    def timed(net) -> float:
        return harness.median_ms(lambda: forward_backward(net, inputs), device=device, repeats=args.repeats,
                                 before=dist.barrier)

    with flowlock.patch(ref), flowlock.patch(model):
        expected = forward_backward(ref, inputs)
        got = forward_backward(model, inputs)
        names = ("sample", "audio_sample", *(f"grad:{k}" for k in LATENTS))
        mismatches = {n: mismatch_count(g, e) for n, g, e in zip(names, got, expected)}
        one_gpu_ms = timed(ref)
        ulysses_ms = timed(model)
    record = {"rank": rank, "mismatches": mismatches, "one_gpu_ms": one_gpu_ms, "ulysses_ms": ulysses_ms}
    # stock diffusers, the same two models unpatched: its own Ulysses (which refuses an S the degree does
    # not divide; recorded as its error) against its own single GPU
    try:
        stock = forward_backward(model, inputs)
        record["stock_mismatches_vs_one_gpu_strict"] = {n: mismatch_count(g, e)
                                                        for n, g, e in zip(names, stock, expected)}
        record["stock_ulysses_ms"] = timed(model)
    except Exception as err:  # recorded: the stock path's limits are part of the evidence
        record["stock_ulysses_error"] = f"{type(err).__name__}: {str(err)[:300]}"
    record["stock_one_gpu_ms"] = timed(ref)
    every = [None] * world
    dist.all_gather_object(every, record)
    if rank == 0:
        report = {"degree": world, "layers": config["num_layers"], "seq": args.seq,
                  "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
                  "commit": os.environ.get("FLOWLOCK_COMMIT"), "torch": torch.__version__, "ranks": every,
                  "bitwise_equal": all(not any(r["mismatches"].values()) for r in every)}
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
        print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
    end_process_groups()
