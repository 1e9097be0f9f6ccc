"""FSDP2 data parallel with exact parameter gradients against one GPU (docs/layouts.md's multi-GPU evidence).

    torchrun --nproc-per-node 2 tools/exact_dp_nccl.py --layers 2 --seq 4253 --micro-batches 2 --out dp2.json

A step is ``N x M`` micro-batches of one sample each, rank ``r`` of ``N`` running samples ``r, r + N, ...``
(:mod:`flowlock.validate.layout_exact_dp`'s protocol, full-width H3 here). Every rank first computes
the one-GPU reference on its own device: all ``N x M`` samples in order, folded by
``MicroBatchGradients`` (the fp32 tree). Then FSDP2 over the ``N`` ranks (verl-omni's units, fp32
master parameters, bf16 compute, fp32 reduction), gradient checkpointing on, runs the same step:

* ``exact``: ``exact_data_parallel`` and ``MicroBatchGradients``; every parameter gradient's
  mismatching elements against the reference (``torch.equal`` semantics);
* ``fsdp2``: the strict model with FSDP2's own reduction (summing, for comparability) and its own
  ``+=`` over micro-batches; the same counts, which show what the exact path changes;
* ``stock``: the unpatched diffusers model under FSDP2's own reduction, timed only.

Each is timed (CUDA events around a whole step, median of ``--repeats`` after a warm-up; perf_counter
on CPU). Rank 0 writes the JSON. ``--tiny --device cpu`` runs the tiny H3 on gloo (the CPU test).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import harness  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import flowlock
from flowlock.models.minimax_h3 import TINY_H3_CONFIG, full_width_config, make_h3, packing_for_length, tiny_inputs
from flowlock.parallel import MicroBatchGradients, exact_data_parallel
from flowlock.parallel.teardown import end_process_groups
from flowlock.testing import mismatch_count
from flowlock.validate.layout_exact_dp import fsdp_with_fp32_masters, micro_batch_step, one_process_trees


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4253)
    parser.add_argument("--micro-batches", type=int, default=2, help="per rank")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tiny H3 (CPU check)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    config = TINY_H3_CONFIG if args.tiny else full_width_config(num_layers=args.layers, num_refiner_layers=1)
    layout = None if args.tiny else packing_for_length(args.seq)
    samples = world * args.micro_batches
    inputs = tiny_inputs(samples, seed=1, config=config, packing=layout, device=device)

    def build():
        model = make_h3(config, device=device, draw_on_device=cuda)
        model.enable_gradient_checkpointing()
        return model

    expected = one_process_trees(inputs, (samples,), ref=build())[samples]
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
    report = {}
    for variant in ("exact", "fsdp2", "stock"):
        model = build()
        fsdp_with_fp32_masters(model, mesh)
        if variant == "exact":
            exact_data_parallel(model)
        else:
            for unit in (m for m in model.modules() if hasattr(m, "set_gradient_divide_factor")):
                unit.set_force_sum_reduction_for_comms(True)
                unit.set_gradient_divide_factor(1.0)
        tree = MicroBatchGradients(model.parameters(), data_parallel_size=world) if variant == "exact" else None

        def run(model=model, tree=tree):
            model.zero_grad(set_to_none=True)
            micro_batch_step(model, inputs, rank, world, args.micro_batches, tree)

        with flowlock.patch(model) if variant != "stock" else contextlib.nullcontext(), flowlock.mode("strict"):
            run()
            entry = {}
            if variant != "stock":
                grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
                differing = {n: mismatch_count(grads[n], expected[n]) for n in sorted(expected)}
                entry.update(parameters=len(differing), equal=sum(1 for v in differing.values() if v == 0),
                             differing_elements=sum(differing.values()))
            entry["step_ms"] = harness.median_ms(run, device=device, repeats=args.repeats,
                                                 before=dist.barrier)
        report[variant] = entry
        del model
    if rank == 0:
        payload = {"script": "tools/exact_dp_nccl.py", "degree": world, "micro_batches_per_rank": args.micro_batches,
                   "layers": config["num_layers"], "seq": args.seq if layout is not None else None,
                   "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                   "commit": os.environ.get("FLOWLOCK_COMMIT"), "variants": report,
                   "exact_equals_one_gpu": report["exact"]["equal"] == report["exact"]["parameters"]}
        with open(args.out, "w") as f:
            json.dump(payload, f, indent=2)
        print(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
    end_process_groups()
