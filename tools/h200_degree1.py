"""The parallel code paths at degree 1 give the plain strict bits, and what they cost (docs/layouts.md, "Degree 1").

One GPU, a real process group of world size 1 (NCCL on CUDA, gloo on CPU; ``file://`` store, rank 0),
the full-width H3 with 2 DiT blocks and 2 refiner blocks (BF16 with the FP32 modules, random weights
drawn on the GPU; ``--tiny``: the tiny H3), one training step at S = 4253 (forward + backward of a
fixed random cotangent into the outputs; text 256 rows, audio S // 16, the rest video, as
``benchmarks/bench_model.py``). Variants, each its own copy of the same weights:

* ``plain``: ``flowlock.patch``, no parallelism (the reference);
* ``ulysses1``: diffusers ``enable_parallelism(ContextParallelConfig(ulysses_degree=1))`` then
  ``flowlock.patch``, and ``reduce_gradients`` after backward. diffusers 0.42 refuses degree 1
  ("Either ring_degree or ulysses_degree must be greater than 1"): the refusal is recorded and the
  flowlock context-parallel path is engaged directly, as ``enable_parallelism`` would leave it: the
  model's parallel config holds a Ulysses mesh of one rank. Since the measurement at 0ffc3d5 (1.62x plain
  when the forward sharded, ran every all-to-all and gathered on a group of 1) flowlock takes the
  plain forward on a one-rank group, so this variant must issue no collective;
* ``fsdp1``: FSDP2 ``fully_shard`` on a 1-rank mesh per block, refiner block, ``norm_out`` and FP32
  module, then the root (verl-omni's trainer units), then ``flowlock.patch``;
* ``fsdp1_ulysses1``: both, as the trainer would run them at dp = 1, sp = 1;
* ``stock`` and ``stock_fsdp1``: unpatched diffusers, alone and under the same FSDP2 units, timed only:
  ``stock_fsdp1 / stock`` is FSDP2's own degree-1 cost, against which ``fsdp1 / plain`` is read
  (``attribution`` in the JSON);
* ``vllm_omni_tp1`` (rollout, forward only; only where vllm and vllm_omni import): vLLM-Omni's
  ``MiniMaxH3DiTModel`` in vLLM's own distributed state at TP = 1 (its groups on the world-1 group),
  the same weights through ``load_weights``, ``flowlock.integrations.vllm_omni.install``: its
  velocities on one vLLM-Omni-packed request of the same S must equal diffusers strict's on the replayed
  request, the strict forward must issue no collective, and its forward is timed against diffusers
  strict's forward on the same request.

Per variant: outputs, latent input gradients and every parameter gradient ``torch.equal`` to
``plain``'s (names of the differing ones recorded), then times: warm-up, then ``--iters`` (>= 5)
rounds of one step per variant with the first variant rotating (``benchmarks/harness.time_rounds``:
CUDA events, median / min / max), peak memory. Any variant's failure is recorded with its error and
the others go on. JSON to ``--out`` with the commit (``FLOWLOCK_COMMIT``), GPU, torch, triton.

GPU (one H200, < 400 s; the H200 image lacks diffusers, carried as ``.whl/``, and vllm / vllm_omni,
so the rollout variant records itself skipped there): ``python3 -m pip install -q --no-index --no-deps
--target /tmp/site .whl/*.whl && PYTHONPATH=/tmp/site FLOWLOCK_COMMIT=<sha> python3
tools/h200_degree1.py --out $OUT/degree1_h200.json``. CPU check of the logic: ``python
tools/h200_degree1.py --tiny --device cpu --out /tmp/degree1.json``. ``--budget-s`` (default 380)
skips the rollout variant when the training variants have used the time up.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "src")]

import harness  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import flowlock  # noqa: E402

LATENTS = ("hidden_states", "audio_hidden_states", "encoder_hidden_states")
TRAIN_VARIANTS = ("plain", "ulysses1", "fsdp1", "fsdp1_ulysses1", "stock", "stock_fsdp1")
# Unpatched diffusers: timed only, to attribute FSDP2's own degree-1 cost (stock arithmetic is not
# the strict bits, so they are not compared).
STOCK_VARIANTS = ("stock", "stock_fsdp1")
FULL_SEQ, TINY_SEQ = 4253, 40
TEXT_ROWS, TINY_TEXT_ROWS = 256, 4


def _error(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"[:2000]


def init_group(device: torch.device, store: str) -> str:
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1, **kwargs)
    return backend


def build(args, device: torch.device):
    from flowlock.models.minimax_h3.tiny import TINY_H3_CONFIG, full_width_config, make_h3

    if args.tiny:
        # the tiny widths, with vLLM-Omni's latent widths so that the rollout variant can load it
        config = dict(TINY_H3_CONFIG, num_layers=args.layers, num_refiner_layers=args.refiner_layers,
                      in_channels=24, audio_in_channels=32)
    else:
        config = full_width_config(num_layers=args.layers, num_refiner_layers=args.refiner_layers)
    model = make_h3(config, seed=0, dtype=torch.bfloat16, device=device, draw_on_device=device.type == "cuda")
    return model.train(), config


def layout(seq: int, text_rows: int):
    from flowlock.models.minimax_h3.packing import build_packing

    audio = seq // 16
    video = seq - text_rows - audio
    side = max(s for s in range(1, 65) if video % (s * s) == 0)
    return build_packing(text_rows, video // (side * side), side, side, audio)


def ulysses_degree1(model, device: torch.device) -> dict:
    """diffusers' degree-1 config, or, when diffusers refuses it, the flowlock CP path engaged directly."""
    from diffusers import ContextParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    try:
        model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=1))
        return {"engaged_by": "diffusers enable_parallelism"}
    except ValueError as err:
        refusal = _error(err)
    mesh = init_device_mesh(device.type, (1, 1), mesh_dim_names=("ring", "ulysses"))
    cp = SimpleNamespace(ring_degree=1, ulysses_degree=1, _ulysses_mesh=mesh["ulysses"], _mesh=mesh)
    model._parallel_config = SimpleNamespace(context_parallel_config=cp)
    return {"engaged_by": "flowlock context-parallel path, a 1-rank Ulysses mesh set as the model's "
                          "context-parallel config (what enable_parallelism records)",
            "diffusers_refused": refusal}


def fsdp1(model, device: torch.device) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from flowlock.validate.layout_worker import shard_over_dp

    shard_over_dp(model, init_device_mesh(device.type, (1,)))


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


class Step:
    """One training step of one variant: forward, backward of fixed cotangents, CP gradient fold."""

    def __init__(self, model, inputs: dict, cots, cp: bool):
        self.model, self.cots, self.cp = model, cots, cp
        self.inputs = {k: (v.clone().requires_grad_() if k in LATENTS else v) for k, v in inputs.items()}

    def setup(self):
        self.model.zero_grad(set_to_none=True)
        for k in LATENTS:
            self.inputs[k].grad = None

    def __call__(self, _state=None):
        out = self.model(**self.inputs)
        torch.autograd.backward([out.sample, out.audio_sample], list(self.cots))
        if self.cp:
            from flowlock.models.minimax_h3.context_parallel import reduce_gradients

            reduce_gradients(self.model)
        return out

    def result(self) -> dict:
        self.setup()
        with _CountCollectives() as counted:
            out = self(None)
        return {"collectives": counted.counts, "outputs": [out.sample.detach(), out.audio_sample.detach()],
                "latent_grads": [self.inputs[k].grad for k in LATENTS],
                "param_grads": {n: _local(p.grad).detach() for n, p in self.model.named_parameters()
                                if p.grad is not None}}


def compare(got: dict, ref: dict) -> dict:
    differ = [f"output {i}" for i, (a, b) in enumerate(zip(got["outputs"], ref["outputs"])) if not torch.equal(a, b)]
    differ += [f"{k}.grad" for k, a, b in zip(LATENTS, got["latent_grads"], ref["latent_grads"])
               if a is None or not torch.equal(a, b)]
    names = sorted(set(got["param_grads"]) | set(ref["param_grads"]))
    params = [n for n in names if n not in got["param_grads"] or n not in ref["param_grads"]
              or not torch.equal(got["param_grads"][n], ref["param_grads"][n])]
    return {"outputs_and_latent_grads_equal": not differ, "differing": differ,
            "param_grads_equal": len(names) - len(params), "param_grads": len(names),
            "differing_param_grads": params[:20], "bitwise_equal": not differ and not params}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_variants(args, device, base, config, report: dict) -> dict:
    seq, text = (TINY_SEQ, TINY_TEXT_ROWS) if args.tiny else (args.seq, TEXT_ROWS)
    lay = layout(seq, text)
    from flowlock.models.minimax_h3.tiny import tiny_inputs

    inputs = tiny_inputs(1, seed=1, config=config, packing=lay, device=device)
    gen = torch.Generator().manual_seed(7)
    shapes = [(1, lay.video_indices.numel(), config["in_channels"] * 4), (1, lay.audio_indices.numel(),
                                                                         config["audio_in_channels"])]
    cots = [torch.randn(s, generator=gen).to(device) for s in shapes]
    report["train"] = {"seq_len": seq, "text_rows": text, "video_rows": lay.video_indices.numel(),
                       "audio_rows": lay.audio_indices.numel(), "variants": {}}
    variants = report["train"]["variants"]
    steps: dict[str, Step] = {}
    handles = []
    names = [n for n in TRAIN_VARIANTS if n in args.variants]
    # every copy before any patch: a deep copy of a patched model keeps the patch
    models = {n: base if n == "plain" else copy.deepcopy(base) for n in names}
    for name in names:
        entry = variants.setdefault(name, {})
        try:
            model = models.pop(name)
            if "ulysses1" in name:
                entry.update(ulysses_degree1(model, device))
            if "fsdp1" in name:
                fsdp1(model, device)
            # FSDP2 turns each unit into an FSDP* class: counted, so a variant that should shard but did not shows
            entry["fsdp2_units"] = sum(type(m).__name__.startswith("FSDP") for m in model.modules())
            if name not in STOCK_VARIANTS:
                handles.append(flowlock.patch(model))
            steps[name] = Step(model, inputs, cots, cp="ulysses1" in name)
        except Exception as err:  # recorded; the other variants go on
            entry["error"] = _error(err)
            entry["traceback"] = traceback.format_exc()[-3000:]
        print(f"set up {name}: {entry.get('error', 'ok')}", flush=True)
    reference = None
    for name, step in list(steps.items()):
        entry = variants[name]
        try:
            start = time.perf_counter()
            result = step.result()
            _sync(device)
            entry["first_call_s"] = round(time.perf_counter() - start, 3)
            entry["collectives_in_step"] = result["collectives"]
            if name == "plain":
                reference = result
                entry["bitwise_equal"] = True
            elif name in STOCK_VARIANTS:
                entry["bitwise_equal"] = None
                entry["compared"] = "no: stock arithmetic, timed for attribution only"
            elif reference is None:
                entry["comparison_error"] = "no plain reference (plain failed)"
            else:
                entry.update(compare(result, reference))
            del result
        except Exception as err:
            entry["error"] = _error(err)
            entry["traceback"] = traceback.format_exc()[-3000:]
            steps.pop(name)
        print(f"{name}: {({k: v for k, v in entry.items() if k != 'traceback'})}", flush=True)
    del reference
    gc.collect()
    peaks: dict[str, float] = {}

    def after(name):
        if device.type == "cuda":
            peaks[name] = max(peaks.get(name, 0.0), torch.cuda.max_memory_allocated(device) / 2**30)

    def setup_for(step):
        def setup():
            step.setup()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
        return setup

    timings = harness.time_rounds({n: s for n, s in steps.items()}, device=device,
                                  setups={n: setup_for(s) for n, s in steps.items()},
                                  rounds=args.iters, warmup=args.warmup, after=after)
    for name, timing in timings.items():
        variants[name]["step"] = timing
        if name in peaks:
            variants[name]["peak_gb"] = round(peaks[name], 3)
    plain = timings.get("plain", {}).get("median_ms")
    for name, timing in timings.items():
        if plain and "median_ms" in timing:
            variants[name]["step_over_plain"] = timing["median_ms"] / plain
    report["train"]["attribution"] = attribution(timings)
    for name, step in steps.items():
        variants[name]["profile"] = profile_step(step, device)
    report["train"]["gpu_attribution"] = gpu_attribution(variants)
    for step in steps.values():
        step.setup()
    for h in handles:
        h.remove()
    return steps


def attribution(timings: dict) -> dict:
    """Degree-1 cost of each parallel wrapper over its own unwrapped model, strict and stock side by side:
    what flowlock adds under FSDP2 is ``fsdp1 / plain`` less ``stock_fsdp1 / stock``."""
    def ratio(num, den):
        a, b = (timings.get(n, {}).get("median_ms") for n in (num, den))
        return a / b if a and b else None

    return {"fsdp1_over_plain": ratio("fsdp1", "plain"), "stock_fsdp1_over_stock": ratio("stock_fsdp1", "stock"),
            "ulysses1_over_plain": ratio("ulysses1", "plain"), "plain_over_stock": ratio("plain", "stock")}


def profile_step(step: Step, device: torch.device) -> dict:
    """One more step of a variant, profiled twice: its GPU time per kernel group (``torch.profiler``)
    and its host time per Python function (``cProfile``), so a degree-1 cost can be told apart as
    device work (copies, casts) or host work (hooks)."""
    try:
        step.setup()
        kernels = harness.kernel_times(step, device, top=sys.maxsize)
        step.setup()
        host = harness.host_profile(step, device, top=15)
    except Exception as err:  # a profiler failure loses this record, not the timings
        return {"error": _error(err)}
    return {"gpu_ms": sum(k["ms"] for k in kernels), "kernels": kernels, "host": host}


def gpu_attribution(variants: dict) -> dict:
    """GPU time of each wrapped variant over its unwrapped model, and the kernel groups the wrapper adds
    or grows (ms more than unwrapped), strict and stock side by side."""
    def gpu(name):
        return variants.get(name, {}).get("profile", {}).get("gpu_ms")

    def added(wrapped, plain):
        a = {k["kernel"]: k["ms"] for k in variants.get(wrapped, {}).get("profile", {}).get("kernels", [])}
        b = {k["kernel"]: k["ms"] for k in variants.get(plain, {}).get("profile", {}).get("kernels", [])}
        grown = {k: round(ms - b.get(k, 0.0), 3) for k, ms in a.items() if ms - b.get(k, 0.0) > 0.05}
        return dict(sorted(grown.items(), key=lambda kv: -kv[1]))

    out = {}
    for wrapped, plain in (("fsdp1", "plain"), ("stock_fsdp1", "stock"), ("ulysses1", "plain")):
        if gpu(wrapped) is not None and gpu(plain) is not None:
            out[f"{wrapped}_minus_{plain}_gpu_ms"] = gpu(wrapped) - gpu(plain)
            out[f"{wrapped}_adds"] = added(wrapped, plain)
    return out


class _CountCollectives:
    NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_to_all_single", "all_to_all",
             "reduce_scatter", "reduce_scatter_tensor", "broadcast", "reduce", "send", "recv", "barrier")

    def __enter__(self):
        self.counts, self.saved = {}, {}
        for name in self.NAMES:
            original = getattr(dist, name, None)
            if original is None:
                continue
            self.saved[name] = original

            def counted(*a, __name=name, __original=original, **kw):
                self.counts[__name] = self.counts.get(__name, 0) + 1
                return __original(*a, **kw)

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc):
        for name, original in self.saved.items():
            setattr(dist, name, original)


def build_native(config: dict, state_dict: dict, device: torch.device, tiny: bool):
    """vLLM-Omni's model at TP = 1 in vLLM's distributed state (reusing this process's world-1 group),
    and the ``VllmConfig`` to run it under."""
    from flowlock.integrations.vllm_omni import runtime

    if tiny:
        sys.path.insert(0, str(ROOT / "tests"))
        from vllm_omni_env import _install_shims

        _install_shims()  # vLLM-Omni has no CPU attention of its own: the test suite's SDPA shim
    return runtime.build_native(config, state_dict, device, adaln_cache=False), runtime.vllm_config(device)
def rollout_variant(args, device, base, config, report: dict) -> None:
    import importlib.util

    entry = report.setdefault("rollout", {})
    missing = [m for m in ("vllm", "vllm_omni") if importlib.util.find_spec(m) is None]
    if missing:
        entry["skipped"] = f"{' and '.join(missing)} not importable here"
        return
    try:
        import bench_vllm_omni

        from flowlock.integrations.vllm_omni import install
        from flowlock.integrations.vllm_omni.minimax_h3.replay import diffusers_requests
        from flowlock.testing import mismatch_count

        native, vllm_config = build_native(config, base.state_dict(), device, args.tiny)
        # S = 4253 packed rows used (text 256 + video 8 x 16 x 30 + audio 157), padded to 64 by vLLM-Omni
        shape = (4, 2, 4, 6, 4) if args.tiny else (256, 8, 32, 60, 157)
        request = bench_vllm_omni.make_request(shape, config["text_dim"], seed=0, device=device)
        kwargs = bench_vllm_omni.native_kwargs([request])
        entry.update(request=dict(zip(("text", "latent_t", "latent_h", "latent_w", "audio_t"), shape)),
                     used_rows=int(request[0].used_len), padded_rows=int(request[0].seq_len))
        replay = diffusers_requests(kwargs)[0]
        from vllm.config import set_current_vllm_config

        with flowlock.patch(base), install(native), set_current_vllm_config(vllm_config):
            base.eval()
            with torch.no_grad(), flowlock.mode("strict"):
                with _CountCollectives() as counted:
                    video, audio = native(**kwargs)
                out = base(**replay.kwargs)
            ref_v = out.sample[0] * replay.update_mask.unsqueeze(-1)
            entry["collectives_in_strict_forward"] = counted.counts
            entry["video_mismatches"] = mismatch_count(video[replay.video_rows], ref_v)
            entry["audio_mismatches"] = mismatch_count(audio[replay.audio_rows], out.audio_sample[0])
            entry["video_elements"], entry["audio_elements"] = ref_v.numel(), out.audio_sample[0].numel()
            entry["bitwise_equal_to_diffusers_strict"] = (entry["video_mismatches"] == 0
                                                          and entry["audio_mismatches"] == 0)
            del video, audio, out, ref_v

            def forward(model, kw):
                def run(_):
                    with torch.no_grad(), flowlock.mode("strict"):
                        model(**kw)
                return run

            entry["forward"] = harness.time_rounds(
                {"vllm_omni_tp1_strict": forward(native, kwargs), "diffusers_strict": forward(base, replay.kwargs)},
                device=device, rounds=args.iters, warmup=args.warmup)
        base.train()
    except Exception as err:
        entry["error"] = _error(err)
        entry["traceback"] = traceback.format_exc()[-3000:]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "degree1_h200.json")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tiny H3 (a CPU check of the script)")
    parser.add_argument("--seq", type=int, default=FULL_SEQ)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--refiner-layers", type=int, default=2)
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--budget-s", type=float, default=380.0)
    parser.add_argument("--variants", default=",".join((*TRAIN_VARIANTS, "vllm_omni_tp1")))
    args = parser.parse_args(argv)
    args.variants = args.variants.split(",")
    if args.iters < 5:
        parser.error("--iters must be >= 5")
    started = time.perf_counter()
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False
    report: dict = {"script": "tools/h200_degree1.py", "tiny": args.tiny,
                    "environment": harness.environment(device), "method": (
                        "one process, world-size-1 process group; one model copy per variant, same weights; "
                        "first call per variant compared with torch.equal to plain strict (outputs, latent "
                        "grads, every parameter grad); then warm-up and rounds of one training step per "
                        "variant, the first variant rotating, CUDA events, median")}
    report["environment"]["vllm"] = harness._version("vllm")
    report["environment"]["vllm_omni"] = harness._version("vllm_omni")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            report["backend"] = init_group(device, os.path.join(tmp, "store"))
            base, config = build(args, device)
            report["config"] = config
            report["parameters"] = sum(p.numel() for p in base.parameters())
            train_variants(args, device, base, config, report)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if "vllm_omni_tp1" in args.variants:
                if time.perf_counter() - started > args.budget_s - 60:
                    report["rollout"] = {"skipped": f"less than 60 s of --budget-s {args.budget_s} left"}
                else:
                    rollout_variant(args, device, base, config, report)
        except Exception as err:
            report["error"] = _error(err)
            report["traceback"] = traceback.format_exc()[-3000:]
        finally:
            report["wall_s"] = round(time.perf_counter() - started, 1)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
    print(summary(report))
    print(f"wrote {args.out}")
    return 0 if "error" not in report else 1


def summary(report: dict) -> str:
    lines = [f"degree 1 on {report['environment'].get('gpu') or report['environment']['device']} "
             f"({report.get('backend')}), {report.get('wall_s')} s"]
    for name, v in report.get("train", {}).get("variants", {}).items():
        if "error" in v:
            lines.append(f"  {name}: ERROR {v['error']}")
            continue
        step = v.get("step", {})
        lines.append(f"  {name}: bitwise {v.get('bitwise_equal')}, param grads {v.get('param_grads_equal', '-')}/"
                     f"{v.get('param_grads', '-')}, step {step.get('median_ms', float('nan')):.2f} ms, "
                     f"x plain {v.get('step_over_plain', float('nan')):.3f}")
    roll = report.get("rollout", {})
    if roll:
        state = roll.get("skipped") or roll.get("error") or roll.get("bitwise_equal_to_diffusers_strict")
        lines.append(f"  vllm_omni_tp1: {state}")
    if "error" in report:
        lines.append(f"  ERROR {report['error']}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
