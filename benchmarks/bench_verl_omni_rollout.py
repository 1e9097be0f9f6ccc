"""Issue 35 GPU evidence: verl-omni's H3 FlowGRPO rollout and the actor's replay, strict and stock, one device.

For the tiny H3 and for H3 at its full widths with 2 blocks and 1 refiner block (BF16, FP32 modules
FP32), a diffusers actor and vLLM-Omni's native DiT loaded from its weights by vLLM-Omni's own
``load_weights``, with flowlock's vLLM plugin switched on (``FLOWLOCK_VLLM_OMNI=strict``: installed at
load, as in a rollout worker):

* exactness: ``--requests`` requests of one layout sampled by flowlock's strict rollout
  (:func:`flowlock.integrations.verl_omni.vllm_request.sample_request`: keyed starting rows and noise,
  flowlock's CPS steps, the strict DiT) with an SDE window of ``--window`` transitions, stacked as
  verl-omni's trainer stacks them and replayed by the strict actor
  (:func:`flowlock.integrations.verl_omni.actor.replay`) in micro-batches of 1 and of all requests:
  max |Δlogp|, the first-epoch importance ratio's extremes and the clip fraction at ``--clip``. The
  same with both forwards stock (the native DiT and the actor in ``flowlock.mode("provider")``:
  vLLM-Omni's and diffusers' own forwards; the sampler and replay math stay flowlock's, so the
  numbers isolate the engines' forward disagreement);
* speed: one request's rollout per denoising step, flowlock (strict DiT, keyed noise, flowlock's CPS)
  against verl-omni's stock step (the stock DiT and verl-omni's own ``FlowMatchSDEDiscreteScheduler``
  CPS step, its noise from one ``torch.Generator`` per request on the device, loaded from the
  verl-omni checkout given by ``--verl-omni``), same process, alternating.

Needs vllm / vllm-omni 0.30.0 importable (on the H200 the pure-Python bundle of
``tools/vllm_omni_bundle.py``, run by ``tools/h200_vllm_omni.sh``). ``--smoke`` runs the tiny H3 on the
CPU with the test suite's shims. Run: ``python benchmarks/bench_verl_omni_rollout.py --verl-omni DIR
--out benchmarks/results/verl_omni_rollout.json``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import harness
import torch

import flowlock

GATE_TESTS = ("tests/integrations/verl_omni",)
# (text rows, latent t, latent h, latent w, audio frames)
TINY_REQUEST = (5, 2, 4, 6, 4)
FULL_REQUEST = (256, 8, 32, 48, 100)  # about 3.5k packed rows
NUM_STEPS, ETA = 8, 0.7
SCHEDULER_FILE = "verl_omni/pipelines/schedulers/flow_match_sde.py"


def _extra(parser) -> None:
    parser.add_argument("--verl-omni", type=Path, required=True, help="a verl-omni checkout (its CPS scheduler)")
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--window", type=int, default=2, help="SDE window: selected transitions per request")
    parser.add_argument("--clip", type=float, default=1e-4, help="PPO clip range for the clip fraction")
    parser.add_argument("--configs", nargs="+", default=["tiny", "full_width"], choices=["tiny", "full_width"])


def _verl_omni_scheduler(root: Path):
    """verl-omni's ``FlowMatchSDEDiscreteScheduler``, loaded from its file (the package's ``__init__``
    imports every pipeline; this module needs only diffusers)."""
    path = root / SCHEDULER_FILE
    if not path.is_file():
        raise SystemExit(f"--verl-omni {root}: no {SCHEDULER_FILE}")
    spec = importlib.util.spec_from_file_location("verl_omni_flow_match_sde", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.FlowMatchSDEDiscreteScheduler


def _request(shape, text_dim: int, seed: int, device):
    from flowlock.integrations.verl_omni.vllm_request import H3Request

    text_len, latent_t, latent_h, latent_w, audio_t = shape
    gen = torch.Generator().manual_seed(seed)
    text = torch.randn(text_len, text_dim, generator=gen).to(torch.bfloat16).to(device)
    return H3Request(text_embeddings=text, text_tags=None, latent_t=latent_t, latent_h=latent_h, latent_w=latent_w,
                     audio_t=audio_t, num_steps=NUM_STEPS)


def _rollout(native, requests, selected, mode) -> dict[str, torch.Tensor]:
    """The requests' records stacked as verl-omni's trainer stacks them (a plain mapping: the replay reads
    any mapping of tensors)."""
    from flowlock.integrations.verl_omni import RequestNoise
    from flowlock.integrations.verl_omni.vllm_request import sample_request

    records = []
    with torch.no_grad(), flowlock.mode(mode):
        for i, request in enumerate(requests):
            result, layout = sample_request(native, request, RequestNoise(7000 + i, i), selected=selected, eta=ETA,
                                            max_text_len=int(request.text_embeddings.shape[0]))
            records.append({**result.record, **layout})
    return {k: torch.cat([r[k] for r in records]) for k in records[0]}


def _replay_stats(diffusers, record, mode, clip: float) -> dict:
    from flowlock.integrations.verl_omni import actor

    batch = record["all_log_probs"].shape[0]
    worst, ratios = 0.0, []
    for rows in ([[i] for i in range(batch)] + [list(range(batch))]):
        micro_batch = {key: value[rows] for key, value in record.items()}
        for transition in range(record["all_log_probs"].shape[1]):
            step = actor.replay_inputs(diffusers, micro_batch, transition, num_inference_steps=NUM_STEPS)
            with torch.no_grad(), flowlock.mode(mode):
                out = actor.replay(diffusers, step, eta=ETA)
            old = micro_batch["all_log_probs"][:, transition]
            worst = max(worst, float((out.log_prob - old).abs().max()))
            ratios.append(torch.exp(out.log_prob.double() - old.double()))
    ratio = torch.cat(ratios)
    return {"max_abs_dlogp": worst, "ratio_min": float(ratio.min()), "ratio_max": float(ratio.max()),
            "clip_fraction": float(((ratio - 1).abs() > clip).double().mean()), "replays": int(ratio.numel())}


def _stock_rollout_fn(native, request, scheduler_cls, device):
    """One request through verl-omni's stock step: the stock DiT, verl-omni's CPS scheduler, a per-request
    device generator (drawn video then audio at every step)."""
    from vllm_omni.diffusion.models.minimax_h3.denoise_loop import MiniMaxH3DenoiseBranch
    from vllm_omni.diffusion.models.minimax_h3.packed_sequence import minimax_h3_packed_sequence

    from flowlock.integrations.verl_omni.vllm_request import GRID_CONVENTION, native_row_widths
    from flowlock.rl import h3_schedules

    packed = minimax_h3_packed_sequence(text_len=int(request.text_embeddings.shape[0]), latent_t=request.latent_t,
                                        latent_h=request.latent_h, latent_w=request.latent_w,
                                        audio_t=request.audio_t, include_keyframe_cond=False)
    branch = MiniMaxH3DenoiseBranch(packed=packed, text_embeddings=request.text_embeddings,
                                    token_tags=packed["token_tags"], device=device)
    sched = h3_schedules(NUM_STEPS, convention=GRID_CONVENTION)
    schedulers = []
    for sigmas in (sched.video_sigmas, sched.audio_sigmas):
        scheduler = scheduler_cls()
        scheduler.sigmas = sigmas.to(device)
        schedulers.append(scheduler)
    (cv, ca), nv, na = native_row_widths(native), branch.img_pos.numel(), branch.audio_pos.numel()

    def run():
        generator = torch.Generator(device=device).manual_seed(1)
        video = torch.randn(1, nv, cv, generator=generator, device=device)
        audio = torch.randn(1, na, ca, generator=generator, device=device)
        with torch.no_grad(), flowlock.mode("provider"):
            for k in range(sched.num_transitions):
                tv, ta = float(sched.video_timesteps[k]), float(sched.audio_timesteps[k])
                v_video, v_audio = native(**branch.forward_kwargs(video_rows=video[0], audio_rows=audio[0], t_video=tv,
                                                                  t_audio=ta, imgvid_cond_timestep=tv,
                                                                  audio_ref_cond_timestep=ta))
                for scheduler in schedulers:
                    scheduler._step_index = k
                video = schedulers[0].sample_previous_step(video, -v_video[None].float(), generator=generator,
                                                           noise_level=ETA, sde_type="cps")[0]
                audio = schedulers[1].sample_previous_step(audio, -v_audio[None].float(), generator=generator,
                                                           noise_level=ETA, sde_type="cps")[0]
        return video, audio

    return run, sched.num_transitions


def _strict_rollout_fn(native, request):
    from flowlock.integrations.verl_omni import RequestNoise
    from flowlock.integrations.verl_omni.vllm_request import sample_request

    def run():
        with torch.no_grad(), flowlock.mode("strict"):
            return sample_request(native, request, RequestNoise(1, 0), selected=range(NUM_STEPS), eta=ETA,
                                  max_text_len=int(request.text_embeddings.shape[0]))

    return run


def _config_run(name, args, device, scheduler_cls) -> dict:
    from flowlock.integrations.vllm_omni import plugin
    from flowlock.integrations.vllm_omni.runtime import build_native
    from flowlock.models.minimax_h3.tiny import TINY_H3_CONFIG, full_width_config, make_h3

    config = ({**TINY_H3_CONFIG, "in_channels": 24, "audio_in_channels": 32} if name == "tiny"
              else full_width_config(num_layers=2, num_refiner_layers=1))
    shape = TINY_REQUEST if name == "tiny" else FULL_REQUEST
    diffusers = make_h3(config, seed=0, dtype=torch.bfloat16, device=device, draw_on_device=device.type == "cuda")
    os.environ[plugin.SWITCH_ENV] = "strict"
    plugin.register()
    try:
        if args.smoke:
            from vllm_omni_env import build_native as build_cpu

            native = build_cpu(config, diffusers.state_dict(), adaln_cache=False)
        else:
            native = build_native(config, diffusers.state_dict(), device, adaln_cache=False)
        if not plugin.installed(native):
            raise RuntimeError("the vLLM plugin did not install flowlock at load")
        requests = [_request(shape, config["text_dim"], seed=i, device=device) for i in range(args.requests)]
        selected = range(1, 1 + args.window)
        with flowlock.patch(diffusers):
            exact = {mode: _replay_stats(diffusers, _rollout(native, requests, selected, mode), mode, args.clip)
                     for mode in ("strict", "provider")}
        timing = harness.time_pair(lambda _: _strict_rollout_fn(native, requests[0])(),
                                   lambda _: _stock_rollout_fn(native, requests[0], scheduler_cls, device)[0](),
                                   device=device, iters=args.iters, warmup=args.warmup)
    finally:
        plugin.unregister()
    steps = _stock_rollout_fn(native, requests[0], scheduler_cls, device)[1]
    per_step = {key: {stat: value / steps for stat, value in timing[side].items() if isinstance(value, float)}
                for key, side in (("flowlock", "a"), ("verl_omni_stock", "b"))}
    row = {"config": name, "request": dict(zip(("text", "latent_t", "latent_h", "latent_w", "audio_t"), shape)),
           "transitions": steps, "exact": {"flowlock": exact["strict"], "stock": exact["provider"]},
           "rollout_per_step_ms": per_step, "flowlock_over_stock": timing["ratio_a_over_b"]}
    print(f"[{name}] Δlogp flowlock {exact['strict']['max_abs_dlogp']} stock {exact['provider']['max_abs_dlogp']}; "
          f"per step flowlock/stock {timing['ratio_a_over_b']:.3f}", flush=True)
    return row


def main(argv=None) -> int:
    args = harness.parse_args(__doc__.splitlines()[0], argv, _extra)
    device = torch.device(args.device)
    gate = harness.gate_or_exit(args, list(GATE_TESTS))
    torch.backends.cuda.matmul.allow_tf32 = False
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import vllm_omni_env as env

    pure_python = env.pin_pure_python_platforms()
    if args.smoke or pure_python:
        env.ensure_runtime()
        env.check_pure_python_platforms()
    scheduler_cls = _verl_omni_scheduler(args.verl_omni)
    rows = [_config_run(name, args, device, scheduler_cls) for name in (["tiny"] if args.smoke else args.configs)]
    payload = {"benchmark": "verl_omni_rollout", "smoke": args.smoke, "gate": gate,
               "environment": {**harness.environment(device), "vllm": harness._version("vllm"),
                               "vllm_omni": harness._version("vllm_omni")},
               "verl_omni_scheduler": str(args.verl_omni / SCHEDULER_FILE), "num_steps": NUM_STEPS, "eta": ETA,
               "method": "exactness: every selected transition of every request replayed alone and in one micro-batch "
                         "of all requests; speed: one request's whole rollout, flowlock vs verl-omni stock, same "
                         "native model instance (provider mode for stock), alternating, median/p20/p80 divided by "
                         "the transitions",
               "results": rows}
    path = harness.write_json(args.out, payload)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
