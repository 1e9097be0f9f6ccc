"""Multi-rank jobs on the real vLLM-Omni 0.30.0 ``MiniMaxH3DiTModel`` (gloo, CPU), one process per rank.

``python vllm_omni_tp_jobs.py OUT JOB [JOB ...]`` imports torch, vLLM, vLLM-Omni and flowlock once, then
runs each job as ``world`` forked ranks (an import costs ~20 s of CPU; a fork costs nothing), each in
vLLM's own distributed environment: ``init_distributed_environment`` and
``initialize_model_parallel(tensor_model_parallel_size=world)`` on gloo, the model built and its
diffusers weights sharded by vLLM-Omni's own ``load_weights``. Rank ``r`` of job ``J`` writes
``OUT/J/rank{r}.log`` (ending ``rank r ok``, or ``rank r: <Error> after <t> s: ...``) and its tensors to
``OUT/J/rank{r}.pt``; the launcher writes ``OUT/J/status.json`` (exit codes, ``None`` for a rank it had
to kill at the deadline, and the wall time).

Jobs: ``trace<N>`` (per-module outputs at TP = N for ``flowlock.validate.layout_trace.compare``),
``sp<N>`` (Ulysses N as vLLM-Omni serves it: its diffusion groups, ``ulysses_degree`` and
its ``_sp_plan`` hooks), ``tp<N>i`` (flowlock's Triton kernels, interpreted, one request),
``tp<N>`` (the exact run, then a planted naive all-reduce; TP = 1 also records the diffusers
strict outputs and counts collectives), ``lora<N>`` (a trainer's peft LoRA synced into vLLM-Omni's
LoRA layers at TP = N, with the trainer's strict outputs), ``disagree`` (rank 1 has one block fewer), ``failing``,
``killed`` and ``stuck`` (rank 1 raises, dies or stalls inside the forward's third K-sharded GEMM).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parents[1] / "src")]
# as tests/conftest.py: Triton runs under its CPU interpreter (the ``i`` jobs run flowlock's kernels)
os.environ.setdefault("TRITON_INTERPRET", "1")

import vllm_omni_env  # noqa: E402

# as tests/integrations/conftest.py, before anything imports vllm (a CUDA build of torch beside a
# Python-only vllm would otherwise resolve vLLM's CUDA platform, which needs vllm's compiled ops)
vllm_omni_env.pin_pure_python_platforms()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from engine_inputs import ENGINE_CONFIG, diffusers_kwargs, make_request, native_kwargs  # noqa: E402
from vllm.config import DeviceConfig, ParallelConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel  # noqa: E402
from vllm_omni.diffusion.data import DiffusionParallelConfig  # noqa: E402
from vllm_omni.diffusion.distributed import parallel_state as omni_state  # noqa: E402
from vllm_omni.diffusion.distributed.sp_plan import SequenceParallelConfig  # noqa: E402
from vllm_omni.diffusion.hooks.sequence_parallel import apply_sequence_parallel  # noqa: E402
from vllm_omni.diffusion.models.minimax_h3.minimax_h3_transformer import MiniMaxH3DiTModel  # noqa: E402
from vllm_omni_env import build_native, ensure_runtime, native_config, vllm_config  # noqa: E402

import flowlock  # noqa: E402
import flowlock.integrations.vllm_omni.minimax_h3.forward as native_forward  # noqa: E402
from flowlock.integrations.vllm_omni import install  # noqa: E402
from flowlock.integrations.vllm_omni.minimax_h3.tensor_parallel import NativeTensorParallel  # noqa: E402
from flowlock.models.minimax_h3 import make_h3  # noqa: E402
from flowlock.ops.linear import linear  # noqa: E402
from flowlock.parallel.ports import free_local_port  # noqa: E402
from flowlock.parallel.shards import RowShards  # noqa: E402
from flowlock.parallel.ulysses import UlyssesSequence  # noqa: E402
from flowlock.testing import poison_  # noqa: E402

# Eight heads so that TP 2, 4 and 8 each own whole heads; every other width divides by 8 as well.
TP_CONFIG = {**ENGINE_CONFIG, "num_attention_heads": 8}
CASES = {
    "padded": [dict(seed=1)],
    "unpadded": [dict(seed=1, seq_len=25)],
    "keyframe": [dict(seed=3, keyframe=True)],
    "packed": [dict(seed=5), dict(seed=6, text_len=7, latent_t=1, audio_t=3, t_video=0.7, t_audio=0.2),
               dict(seed=7, keyframe=True, seq_len=41)],
}
INTERPRETED_CASES = {"unpadded": CASES["unpadded"]}
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_to_all_single", "all_to_all",
               "reduce_scatter", "reduce_scatter_tensor", "broadcast", "reduce", "send", "recv", "barrier")
# The process-group timeout of the ``stuck`` job; the others wait long enough for a loaded CI machine
# (an interpreted rank can run a minute ahead of its peer).
PG_TIMEOUT_S = 5
SLOW_PG_TIMEOUT_S = 300
FAULT_CALL = 3


def _poison_allocations() -> None:
    # as tests/conftest.py does: a buffer the code forgets to fill is NaN, never a stale value
    for name in ("empty", "empty_like", "empty_strided"):
        original = getattr(torch, name)
        setattr(torch, name, lambda *a, __original=original, **k: poison_(__original(*a, **k)))


def _count_collectives() -> dict[str, int]:
    """Count every torch.distributed collective called from now on (flowlock's and vLLM's alike)."""
    counts = dict.fromkeys(COLLECTIVES, 0)
    for name in COLLECTIVES:
        original = getattr(dist, name)

        def counted(*args, __name=name, __original=original, **kwargs):
            counts[__name] += 1
            return __original(*args, **kwargs)

        setattr(dist, name, counted)
    return counts


def _runtime(name: str, rank: int, world: int, port: int) -> None:
    """vLLM's environment for ``tp<N>`` jobs; vLLM-Omni's diffusion groups (Ulysses = world) for ``sp<N>``."""
    seconds = PG_TIMEOUT_S if name == "stuck" else SLOW_PG_TIMEOUT_S
    timeout = timedelta(seconds=seconds)
    config = VllmConfig(device_config=DeviceConfig("cpu"),
                        parallel_config=ParallelConfig(distributed_timeout_seconds=seconds,
                                                       cpu_distributed_timeout_seconds=seconds))
    init = f"tcp://127.0.0.1:{port}"
    with set_current_vllm_config(config):
        if name.startswith("sp"):
            # vLLM-Omni's own init wants a device count the CPU platform does not have: the default
            # group comes first, then vLLM-Omni builds its world, SP and (TP = 1) vLLM groups on it.
            dist.init_process_group("gloo", init_method=init, world_size=world, rank=rank,
                                    timeout=timeout)
            omni_state.init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo",
                                                    distributed_init_method=init)
            omni_state.initialize_model_parallel(ulysses_degree=world, sequence_parallel_size=world,
                                                 data_parallel_size=1, backend="gloo")
        else:
            init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo",
                                         distributed_init_method=init, timeout=timeout)
            initialize_model_parallel(tensor_model_parallel_size=world)


def _models():
    diffusers = make_h3(TP_CONFIG, seed=0)
    return diffusers, build_native(TP_CONFIG, diffusers.state_dict())


def _ulysses_models(degree: int):
    """The native model as vLLM-Omni serves Ulysses: ``ulysses_degree`` in its parallel config and its
    ``_sp_plan`` hooks applied."""
    ensure_runtime()
    diffusers = make_h3(TP_CONFIG, seed=0)
    od_config = SimpleNamespace(tf_model_config=native_config(TP_CONFIG), num_gpus=degree,
                                parallel_config=DiffusionParallelConfig(ulysses_degree=degree, data_parallel_size=1),
                                cache_config={"minimax_h3_adaln_cache": True})
    with set_current_vllm_config(vllm_config()):
        native = MiniMaxH3DiTModel(od_config, None)
    native.load_weights(diffusers.state_dict().items())
    native.post_load_weights()
    apply_sequence_parallel(native, SequenceParallelConfig(ulysses_degree=degree), native._sp_plan)
    return diffusers, native.eval()


def _native_outputs(native) -> dict[str, torch.Tensor]:
    out = {}
    with torch.no_grad(), flowlock.mode("strict"):
        for case, specs in CASES.items():
            out[f"{case}.video"], out[f"{case}.audio"] = native(**native_kwargs([make_request(**s) for s in specs]))
    return out


def job_interpreted(rank: int, world: int, out: Path) -> None:
    """The kernels a GPU rollout runs (Triton, interpreted) on one uneven request (25 rows)."""
    _, native = _models()
    ((case, specs),) = INTERPRETED_CASES.items()
    with torch.no_grad(), install(native), flowlock.use_backend("triton"), flowlock.mode("strict") as frame:
        video, audio = native(**native_kwargs([make_request(**s) for s in specs]))
    saved = {f"{case}.video": video, f"{case}.audio": audio,
             "backends": sorted({backend for _, backend in frame.ran})}
    torch.save(saved, out / f"rank{rank}.pt")


def _diffusers_outputs(diffusers) -> dict[str, torch.Tensor]:
    """Each request of every case alone through diffusers + flowlock.patch (condition rows zeroed as vLLM-Omni does)."""
    out = {}
    with torch.no_grad(), flowlock.patch(diffusers), flowlock.mode("strict"):
        for case, specs in CASES.items():
            for i, spec in enumerate(specs):
                request = make_request(**spec)
                result = diffusers(**diffusers_kwargs(request))
                out[f"{case}.{i}.video"] = result.sample[0] * request.branch.update_mask.unsqueeze(-1)
                out[f"{case}.{i}.audio"] = result.audio_sample[0]
    return out


def _naive_k_sharded_linear(self, module, x):
    # vLLM's stock row-parallel forward: a partial GEMM over this rank's K block, rounded to the
    # output dtype, then the partials summed by the backend's all-reduce.
    partial = linear(x, module.weight)
    dist.all_reduce(partial, group=self.tp.group)
    return partial


def _refiner_through_ulysses(original):
    # what stock diffusers does under Ulysses: the replicated text goes through the all-to-all as if
    # each rank's shard were the whole text, and attends over its N copies as one document
    def attention(run, attn, x, rope, docs, own_kwargs, sequence=None):
        if sequence is None and run.sp is not None:
            n, rows = run.sp.degree, x.shape[0]
            ulysses = run.sp.ulysses
            sequence = UlyssesSequence(RowShards(n * rows, n, ulysses.rank), ulysses.group)
            docs = ((0, n * rows),)
        return original(run, attn, x, rope, docs, own_kwargs, sequence)

    return attention


def job_ulysses(rank: int, world: int, out: Path) -> None:
    _, native = _ulysses_models(world)
    counts = _count_collectives()
    with install(native):
        saved = _native_outputs(native)
        sequence_parallel = getattr(native, "_flowlock_ulysses", None)
    saved["collectives.forwards"] = dict(counts)
    original = native_forward.attention_forward
    native_forward.attention_forward = _refiner_through_ulysses(original)
    try:
        with install(native):
            saved.update({f"planted.{k}": v for k, v in _native_outputs(native).items()})
    finally:
        native_forward.attention_forward = original
    saved["ulysses_degree"] = 0 if sequence_parallel is None else sequence_parallel.degree
    saved["sp_hooks"] = sorted(n for n, m in native.named_modules() if getattr(m, "_hook_registry", None) is not None)
    torch.save(saved, out / f"rank{rank}.pt")


def job_layout(rank: int, world: int, out: Path) -> None:
    diffusers, native = _models()
    saved = {}
    counts = _count_collectives()
    with install(native) as handle:
        install_counts = dict(counts)
        saved.update(_native_outputs(native))
        forward_counts = {k: v - install_counts[k] for k, v in counts.items()}
        tensor_parallel = getattr(native, "_flowlock_tensor_parallel", None)
    saved["collectives.install"] = install_counts
    saved["collectives.forwards"] = forward_counts
    saved["tensor_parallel_degree"] = 1 if tensor_parallel is None else tensor_parallel.degree
    saved["removed_attribute"] = hasattr(native, "_flowlock_tensor_parallel") or handle.active
    if world == 1:
        saved.update({f"diffusers.{k}": v for k, v in _diffusers_outputs(diffusers).items()})
    else:
        original = NativeTensorParallel.k_sharded_linear
        NativeTensorParallel.k_sharded_linear = _naive_k_sharded_linear
        try:
            with install(native):
                saved.update({f"planted.{k}": v for k, v in _native_outputs(native).items()})
        finally:
            NativeTensorParallel.k_sharded_linear = original
    torch.save(saved, out / f"rank{rank}.pt")


def _rank1_last_fc2(native, rank: int):
    """A planted fault on rank 1 alone: the last block's ``fc2`` output, after its row gather, gets
    +1 in row 0, column 0 there. Nothing after it in that block exchanges data, so only rank 1's
    ``blocks.<last>`` output differs (the final layer's column gather then spreads it)."""
    original = NativeTensorParallel.k_sharded_linear
    target = native.blocks[-1].mlp.fc2

    def planted(self, module, x):
        y = original(self, module, x)
        if rank == 1 and module is target:
            y = y.clone()
            y[0, 0] += 1.0
        return y

    return planted


def job_trace(rank: int, world: int, out: Path) -> None:
    """``flowlock trace`` across TP degrees: every module output of one strict forward (the
    ``unpadded`` request, 25 rows) recorded on each rank, clean and with two plants (a no-op at
    TP = 1, which issues no K-sharded linear): the stock row-parallel all-reduce, and a fault on
    rank 1 alone. Saved in :func:`flowlock.validate.layout_trace.compare`'s form."""
    from flowlock.validate.trace import capture

    _, native = _models()
    kwargs = native_kwargs([make_request(**s) for s in CASES["unpadded"]])
    # activations are replicated under TP: every record is compared whole (no row or sample shards)
    meta = dict(rank=rank, world=world, tp_rank=rank, seq_len=-1, batch=-1, batch_start=0, local_batch=-1,
                rows=[0, 0])
    saved = {}
    plants = {"clean": None, "naive_all_reduce": _naive_k_sharded_linear,
              "rank1_fault": _rank1_last_fc2(native, rank)}
    original = NativeTensorParallel.k_sharded_linear
    for name, plant in plants.items():
        NativeTensorParallel.k_sharded_linear = plant or original
        try:
            with install(native), flowlock.mode("strict"):
                records = capture(native, lambda: native(**kwargs))
        finally:
            NativeTensorParallel.k_sharded_linear = original
        saved[name] = {"meta": meta, "forward": [(r.name, list(r.outputs)) for r in records], "backward": []}
    torch.save(saved, out / f"rank{rank}.pt")


def job_disagree(rank: int, world: int, out: Path) -> None:
    _, native = _models()
    if rank == 1:
        native.blocks = native.blocks[:1]
    install(native)


def _fault(rank: int, action) -> None:
    calls = [0]
    original = NativeTensorParallel.k_sharded_linear

    def faulty(self, module, x):
        calls[0] += 1
        if rank == 1 and calls[0] == FAULT_CALL:
            action()
        return original(self, module, x)

    NativeTensorParallel.k_sharded_linear = faulty


def _raise():
    raise RuntimeError("planted failure on rank 1")


def _stall():
    time.sleep(4 * PG_TIMEOUT_S)


FAULTS = {"failing": _raise, "killed": lambda: os.kill(os.getpid(), signal.SIGKILL), "stuck": _stall}


def job_fault(name: str):
    def run(rank: int, world: int, out: Path) -> None:
        _, native = _models()
        _fault(rank, FAULTS[name])
        with install(native):
            _native_outputs(native)

    return run


def _lora_trainer():
    """The diffusers H3 with a peft LoRA as after training (per-module ranks 4 and 8, scale 2), its base
    weights and its LoRA state dict (as in test_vllm_omni_lora)."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from flowlock.models.common.peft_lora import is_peft_lora

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj",
                                                           "ff.net.2"],
                        rank_pattern={"ff.net.2": 8}, alpha_pattern={"ff.net.2": 16})
    diffusers = make_h3(TP_CONFIG, seed=0)
    base = diffusers.state_dict()
    diffusers.add_adapter(config)
    gen = torch.Generator().manual_seed(3)
    for module in diffusers.modules():
        if is_peft_lora(module):
            for factor in (module.lora_A["default"], module.lora_B["default"]):
                factor.weight.data = (torch.randn(factor.weight.shape, generator=gen) * 0.2).to(torch.bfloat16)
    return diffusers, base, get_peft_model_state_dict(diffusers), config


def job_lora(rank: int, world: int, out: Path) -> None:
    """The trainer's LoRA synced into vLLM-Omni's own LoRA layers at TP = ``world``
    (``map_lora_update_to_engine``, ``add_lora_to_engine``: vLLM slices the factors per rank), the
    strict outputs of every case, and the trainer's (diffusers + peft, strict) per request."""
    from flowlock.integrations.vllm_omni.lora import add_lora_to_engine, map_lora_update_to_engine

    diffusers, base, tensors, config = _lora_trainer()
    native = build_native(TP_CONFIG, base)
    mapped, engine_config = map_lora_update_to_engine(tensors, config.to_dict(), model=native)
    manager = add_lora_to_engine(native, mapped, engine_config)
    with install(native):
        saved = _native_outputs(native)
    saved.update({f"diffusers.{k}": v for k, v in _diffusers_outputs(diffusers).items()})
    saved["lora_layers"] = sum(1 for m in native.modules() if type(m).__name__.endswith("WithLoRA"))
    saved["lora_tp_size"] = sorted({m.tp_size for m in native.modules() if type(m).__name__.endswith("WithLoRA")})
    del manager
    torch.save(saved, out / f"rank{rank}.pt")


def _job(name: str):
    if name.startswith("lora"):
        return int(name[4:]), job_lora
    if name.startswith("trace"):
        return int(name[5:]), job_trace
    if name.startswith("tp") and name.endswith("i"):
        return int(name[2:-1]), job_interpreted
    if name.startswith("tp"):
        return int(name[2:]), job_layout
    if name.startswith("sp"):
        return int(name[2:]), job_ulysses
    if name == "disagree":
        return 2, job_disagree
    return 2, job_fault(name)


def _child(name: str, rank: int, world: int, port: int, out: Path) -> None:
    log = open(out / f"rank{rank}.log", "w", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    torch.set_num_threads(1)
    _poison_allocations()
    start = time.monotonic()
    code = 0
    try:
        _runtime(name, rank, world, port)
        _job(name)[1](rank, world, out)
        print(f"rank {rank} ok", flush=True)
    except BaseException as err:  # noqa: BLE001 - the log names whatever ended this rank
        traceback.print_exc()
        print(f"rank {rank}: {type(err).__name__} after {time.monotonic() - start:.2f} s: {err}", flush=True)
        code = 1
    log.flush()
    # skip interpreter teardown: a peer that died leaves gloo threads that can block a clean exit
    os._exit(code)




def run_job(name: str, root: Path, deadline_s: float) -> None:
    world, _ = _job(name)
    out = root / name
    out.mkdir(parents=True, exist_ok=True)
    context = multiprocessing.get_context("fork")
    port = free_local_port()
    start = time.monotonic()
    procs = [context.Process(target=_child, args=(name, rank, world, port, out)) for rank in range(world)]
    for proc in procs:
        proc.start()
    codes = []
    for proc in procs:
        proc.join(max(0.1, deadline_s - (time.monotonic() - start)))
        if proc.is_alive():
            proc.kill()
            proc.join()
            codes.append(None)
        else:
            codes.append(proc.exitcode)
    (out / "status.json").write_text(json.dumps({"exitcodes": codes, "wall_s": time.monotonic() - start}))


def main(argv: list[str]) -> None:
    root, names = Path(argv[0]), argv[1:]
    deadline_s = float(os.environ.get("FLOWLOCK_JOB_DEADLINE_S", "300"))
    for name in names:
        run_job(name, root, deadline_s)


if __name__ == "__main__":
    main(sys.argv[1:])
