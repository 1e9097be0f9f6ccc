"""vLLM-Omni tensor or Ulysses parallel on NCCL GPUs: every rank's velocities against one GPU, full-width H3.

    torchrun --nproc-per-node N tools/vllm_omni_tp_nccl.py [--sp] --layers 2 --out vllm_omni_tp_nccl_N.json

The rollout side of the multi-GPU layout evidence (docs/layouts.md) as one torchrun call. Every rank runs
the engine's own distributed state: vLLM's at TP = N (``init_distributed_environment`` +
``initialize_model_parallel``), or with ``--sp`` vLLM-Omni's diffusion groups at Ulysses = N with its
``_sp_plan`` hooks; it builds vLLM-Omni's ``MiniMaxH3DiTModel`` from the same seeded diffusers H3
(``load_weights`` shards it at TP > 1), then, on one packed request of S rows (vLLM-Omni's packing,
padded to 64):

* ``one_gpu``: diffusers + ``flowlock.patch`` on this rank alone, the replayed request (the single-GPU
  contract: TP = 1's bits are the trainer's bits);
* ``flowlock_parallel``: the native model under ``flowlock.integrations.vllm_omni.install`` at degree N;
* ``stock_parallel``: the native model as vLLM-Omni runs it (its row-parallel all-reduce, or its
  Ulysses all-to-alls on the padded sequence).

Per rank: mismatching elements of video and audio velocities against ``one_gpu`` (``torch.equal``
semantics; flowlock must have none), and the three forwards timed in the same rounds (CUDA events,
``benchmarks/harness.time_rounds``). Rank 0 gathers every rank's record and writes the JSON with the
commit (``FLOWLOCK_COMMIT``), GPU, torch, triton and vllm versions.

The H200 image has no vllm: carry the pure-Python bundle (``tools/vllm_omni_bundle.py``), install it as
``tools/h200_vllm_omni.sh`` does, and the test suite's pins (``tests/vllm_omni_env.py``) make vLLM and
vLLM-Omni run on their unspecified platforms with vLLM-Omni's SDPA attention for the stock path.
CPU form (gloo, tiny H3 with 8 heads, flowlock's reference backend): ``torchrun --nproc-per-node 2
tools/vllm_omni_tp_nccl.py --tiny --device cpu --out /tmp/tp.json`` (tested in
``tests/benchmarks/test_vllm_omni_tp_nccl_script.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks"), str(ROOT / "src")]

import vllm_omni_env  # noqa: E402

PURE_PYTHON = vllm_omni_env.pin_pure_python_platforms()  # before anything imports vllm

import harness  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import flowlock  # noqa: E402
from flowlock.parallel.teardown import end_process_groups  # noqa: E402
from flowlock.testing import mismatch_count  # noqa: E402

# (text, latent t, h, w, audio t): 256 + 8 x 16 x 30 + 157 = 4253 rows used (bench_vllm_omni's request)
FULL_REQUEST = (256, 8, 32, 60, 157)
TINY_REQUEST = (4, 2, 4, 6, 4)


def _config(args) -> dict:
    from flowlock.models.minimax_h3 import full_width_config
    from flowlock.models.minimax_h3.tiny import TINY_H3_CONFIG

    if args.tiny:
        # eight heads, so TP 2, 4 and 8 each own whole heads
        return {**TINY_H3_CONFIG, "in_channels": 24, "audio_in_channels": 32, "num_attention_heads": 8}
    return full_width_config(num_layers=args.layers, num_refiner_layers=args.refiner_layers)


def _vllm_config(device: torch.device):
    """The ``VllmConfig`` context the native model is built and run under."""
    from vllm.config import set_current_vllm_config

    from flowlock.integrations.vllm_omni.runtime import vllm_config

    return set_current_vllm_config(vllm_config(device))


def _vllm_environment(device: torch.device, world: int, rank: int, local_rank: int, sp: bool) -> None:
    """The engine's own distributed state from torchrun's env (NCCL on CUDA, gloo on the CPU): vLLM's at
    TP = ``world``, or with ``sp`` vLLM-Omni's diffusion groups at Ulysses = ``world`` (and vLLM's TP = 1)."""
    from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from vllm_omni.diffusion.distributed import parallel_state as omni_state

    backend = "nccl" if device.type == "cuda" else "gloo"
    with _vllm_config(device):
        if sp:
            # vLLM-Omni's own init asks the platform for a device count: the default group comes first
            dist.init_process_group(backend, init_method="env://", world_size=world, rank=rank)
            omni_state.init_distributed_environment(world_size=world, rank=rank, local_rank=local_rank,
                                                    backend=backend, distributed_init_method="env://")
            omni_state.initialize_model_parallel(ulysses_degree=world, sequence_parallel_size=world,
                                                 data_parallel_size=1, backend=backend)
        else:
            init_distributed_environment(world_size=world, rank=rank, local_rank=local_rank,
                                         distributed_init_method="env://", backend=backend)
            initialize_model_parallel(tensor_model_parallel_size=world)


def _native_ulysses(config: dict, state_dict: dict, device: torch.device, degree: int):
    """vLLM-Omni's model as it serves Ulysses ``degree``: ``ulysses_degree`` in its parallel config and its
    ``_sp_plan`` hooks applied, the diffusers weights through its own ``load_weights``."""
    from types import SimpleNamespace

    from vllm_omni.diffusion.data import DiffusionParallelConfig
    from vllm_omni.diffusion.distributed.sp_plan import SequenceParallelConfig
    from vllm_omni.diffusion.hooks.sequence_parallel import apply_sequence_parallel
    from vllm_omni.diffusion.models.minimax_h3.minimax_h3_transformer import MiniMaxH3DiTModel

    od_config = SimpleNamespace(tf_model_config=vllm_omni_env.native_config(config), num_gpus=degree,
                                parallel_config=DiffusionParallelConfig(ulysses_degree=degree, data_parallel_size=1),
                                cache_config={"minimax_h3_adaln_cache": False})
    with _vllm_config(device), torch.device(device):
        native = MiniMaxH3DiTModel(od_config, None)
    native.load_weights(state_dict.items())
    native.post_load_weights()
    apply_sequence_parallel(native, SequenceParallelConfig(ulysses_degree=degree), native._sp_plan)
    return native.eval()


def _forward(model, kwargs: dict, strict: bool):
    def run(_=None):
        with torch.no_grad():
            if strict:
                with flowlock.mode("strict"):
                    return model(**kwargs)
            return model(**kwargs)
    return run


def rank_record(args, device: torch.device) -> dict:
    import bench_vllm_omni

    from flowlock.integrations.vllm_omni import install
    from flowlock.integrations.vllm_omni.minimax_h3.replay import diffusers_requests
    from flowlock.integrations.vllm_omni.runtime import build_native
    from flowlock.models.minimax_h3 import make_h3

    config = _config(args)
    diffusers = make_h3(config, seed=0, device=device, draw_on_device=not args.tiny)
    if PURE_PYTHON or device.type == "cpu":
        # vLLM-Omni selects no attention backend on its unspecified platform: its SDPA one (stock path only)
        vllm_omni_env._install_shims()
    if args.sp:
        native = _native_ulysses(config, diffusers.state_dict(), device, dist.get_world_size())
    else:
        with _vllm_config(device):
            native = build_native(config, diffusers.state_dict(), device, adaln_cache=False)
    shape = TINY_REQUEST if args.tiny else FULL_REQUEST
    request = bench_vllm_omni.make_request(shape, config["text_dim"], seed=0, device=device)
    kwargs = bench_vllm_omni.native_kwargs([request])
    replay = diffusers_requests(kwargs)[0]
    record = {"rows_used": int(request[0].used_len), "rows_padded": int(request[0].seq_len)}
    with flowlock.patch(diffusers):
        out = _forward(diffusers, replay.kwargs, strict=True)()
    ref_video = out.sample[0] * replay.update_mask.unsqueeze(-1)
    ref_audio = out.audio_sample[0]
    del out

    def mismatches(video, audio) -> dict:
        return {"video": mismatch_count(video[replay.video_rows], ref_video),
                "audio": mismatch_count(audio[replay.audio_rows], ref_audio)}

    with _vllm_config(device):
        record["stock_parallel_mismatches"] = mismatches(*_forward(native, kwargs, strict=False)())
        with install(native), flowlock.patch(diffusers):
            # the degree flowlock's adapter engaged (None: it ran the plain TP = 1 forward)
            engaged = getattr(native, "_flowlock_ulysses" if args.sp else "_flowlock_tensor_parallel", None)
            record["flowlock_degree"] = None if engaged is None else engaged.degree
            record["flowlock_parallel_mismatches"] = mismatches(*_forward(native, kwargs, strict=True)())
            record["elements"] = {"video": ref_video.numel(), "audio": ref_audio.numel()}
            record["bitwise_equal_to_one_gpu"] = not any(record["flowlock_parallel_mismatches"].values())
            calls = {"one_gpu": _forward(diffusers, replay.kwargs, strict=True),
                     "flowlock_parallel": _forward(native, kwargs, strict=True)}
            timed = harness.time_rounds(calls, device=device, rounds=args.iters, warmup=args.warmup)
        timed.update(harness.time_rounds({"stock_parallel": _forward(native, kwargs, strict=False)}, device=device,
                                         rounds=args.iters, warmup=args.warmup))
    record["forward_ms"] = {name: {k: r[k] for k in ("median_ms", "min_ms", "max_ms", "n")} if "error" not in r else r
                            for name, r in timed.items()}
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tiny H3 (8 heads): a CPU check of the script")
    parser.add_argument("--sp", action="store_true", help="vLLM-Omni's Ulysses (its own groups and SP hooks), not TP")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--refiner-layers", type=int, default=1)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    _vllm_environment(device, world, rank, local_rank, args.sp)
    try:
        record = rank_record(args, device)
    except Exception as err:  # recorded and gathered: one rank's failure is every rank's report
        record = {"error": f"{type(err).__name__}: {err}"}
    records = [None] * world
    dist.all_gather_object(records, record)
    if rank == 0:
        import vllm

        payload = {"script": "tools/vllm_omni_tp_nccl.py", "layout": "ulysses" if args.sp else "tp",
                   "degree": world, "tiny": args.tiny,
                   "backend": dist.get_backend(), "pure_python_vllm": PURE_PYTHON, "vllm": vllm.__version__,
                   "environment": harness.environment(device), "request": TINY_REQUEST if args.tiny else FULL_REQUEST,
                   "config": _config(args), "ranks": records,
                   "all_ranks_bitwise_equal_to_one_gpu": all(r.get("bitwise_equal_to_one_gpu") for r in records)}
        harness.write_json(args.out, payload)
        equal = payload["all_ranks_bitwise_equal_to_one_gpu"]
        print(f"{'Ulysses' if args.sp else 'TP'} {world}: every rank equal to one GPU: {equal}; wrote {args.out}",
              flush=True)
    return 0 if all(r.get("bitwise_equal_to_one_gpu") for r in records) else 1


if __name__ == "__main__":
    code = main()
    end_process_groups()
    raise SystemExit(code)
