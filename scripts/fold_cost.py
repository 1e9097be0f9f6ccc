"""Cost of flowlock's fixed-order gradient fold against the backend's all-reduce, same tensors.

    torchrun --nproc-per-node N scripts/fold_cost.py --backend nccl --elements 67108864
    (CPU: --backend gloo, started the same way)

Times ``flowlock.parallel.fold_sum_`` (fp32 all-to-all, rank-order fold, all-gather) and
``dist.all_reduce`` (in bf16, and on an fp32 copy: the fold's bytes) on one bf16 gradient bucket
of ``--elements`` values; median of ``--repeats`` after a warm-up. Rank 0 prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from flowlock.parallel import fold_sum_
from flowlock.parallel.teardown import end_process_groups


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--elements", type=int, default=1 << 22)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    dist.init_process_group(args.backend)
    device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count()) if args.backend == "nccl" else "cpu"
    grad = torch.randn(args.elements, generator=torch.Generator().manual_seed(dist.get_rank())).bfloat16().to(device)

    def timed(fn):
        fn()
        times = []
        for _ in range(args.repeats):
            dist.barrier()
            if args.backend == "nccl":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if args.backend == "nccl":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    fold_ms = timed(lambda: fold_sum_([grad.clone()]))
    all_reduce_ms = timed(lambda: dist.all_reduce(grad.clone()))
    all_reduce_fp32_ms = timed(lambda: dist.all_reduce(grad.float()))
    if dist.get_rank() == 0:
        print(json.dumps({"backend": args.backend, "world": dist.get_world_size(), "elements": args.elements,
                          "fold_ms": round(fold_ms, 2), "all_reduce_bf16_ms": round(all_reduce_ms, 2),
                          "all_reduce_fp32_ms": round(all_reduce_fp32_ms, 2),
                          "ratio": round(fold_ms / all_reduce_ms, 2)}))


if __name__ == "__main__":
    main()
    end_process_groups()
