"""A two-iteration run of the tiny MiniMax-H3 through verl-omni's own H3 adapter classes, flowlock on and off.

Developer harness, never CI: it needs verl-omni importable (``tools/verl_omni_h3_suite.sh`` builds that
environment from a verl-omni checkout). The classes come from verl-omni's registries, as verl-omni's
engine and rollout server look them up: with flowlock on, after importing
``flowlock.integrations.verl_omni.register`` (the ``external_lib`` target); off, verl-omni's built-in ones.

The rollout engine is vLLM-Omni 0.30.0's native ``MiniMaxH3DiTModel`` loaded from the actor's weights
(flowlock on: put strict by flowlock's vLLM plugin at load, as in a rollout worker; off: stock). The actor
is the diffusers ``MiniMaxH3Transformer3DModel`` wrapped by peft LoRA, as verl-omni's LoRA actor holds it.
Each iteration: ``--requests`` requests rolled out, the actor's replay, then a LoRA update on the actor
(A and B moved as an optimizer step moves them) synced to the rollout; iteration 2 rolls out with the
synced weights. With flowlock on, iteration 1 starts with a full-weight sync through the rollout
pipeline's ``load_weights`` (three buckets, as verl-omni's checkpoint engine sends them).

* DiffusionNFT (verl-omni's ``diffusion_nft`` classes): the rollout pipeline class's ``diffuse`` samples
  each request; the trainer noises the clean sample at a training timestep (keyed noise) and the actor
  class's ``prepare_model_inputs`` / ``forward`` give the velocity; the rollout engine's velocity on the
  same input (vLLM-Omni's packing, the request's timestep for both modalities, as the NFT actor uses it) is
  compared: max |Δv|, and with flowlock on, the actor's regeneration of the clean sample from the
  recorded noise key (max |Δx0|).
* FlowGRPO-CPS (verl-omni's ``flow_grpo`` classes, where the checkout has them): the rollout class's
  ``diffuse`` records the selected CPS transitions and log-probs; the actor class's
  ``prepare_model_inputs`` / ``forward_and_sample_previous_step`` replay them: max |Δlogp|, the
  first-epoch importance ratio's extremes and the clip fraction.

``python tools/verl_omni_h3_run.py --out DIR`` writes ``DIR/verl_omni_h3_run.json`` and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "integrations"))

import vllm_omni_env  # noqa: E402

vllm_omni_env.pin_pure_python_platforms()

import torch  # noqa: E402

ARCH = "MiniMaxH3Pipeline"
NUM_STEPS, ETA, CLIP = 4, 0.7, 1e-4
SHAPE = dict(latent_t=2, latent_h=4, latent_w=6, audio_t=4)
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"]


def _verl_omni_commit() -> str | None:
    import verl_omni

    root = Path(verl_omni.__file__).resolve().parents[1]
    marker = root / "VERL_OMNI_COMMIT"
    if marker.is_file():
        return marker.read_text().strip()
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _models(seed: int):
    """The actor (diffusers H3 + peft LoRA, B = 0 as peft initialises it) and the rollout's native DiT
    loaded from the actor's base weights through the vLLM plugin's load hook."""
    from engine_inputs import ENGINE_CONFIG
    from peft import LoraConfig, get_peft_model
    from vllm_omni_env import build_native

    from flowlock.models.minimax_h3 import make_h3

    base = make_h3(ENGINE_CONFIG, seed=seed)
    native = build_native(ENGINE_CONFIG, base.state_dict())
    config = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0)
    # bf16 factors, as the base: vLLM-Omni computes LoRA in the base dtype (peft would upcast them to fp32)
    return get_peft_model(base, config, autocast_adapter_dtype=False), native, config


def _lora_update(actor, step: int) -> dict[str, torch.Tensor]:
    """Move every LoRA factor as an optimizer step would (in place); return the factors as verl-omni's
    actor sends them (peft state-dict names)."""
    from peft.utils import get_peft_model_state_dict

    gen = torch.Generator().manual_seed(1000 + step)
    with torch.no_grad():
        for name, p in actor.named_parameters():
            if "lora_" in name:
                p.add_((torch.randn(p.shape, generator=gen) * 0.05).to(p.dtype))
    return dict(get_peft_model_state_dict(actor))


def _full_sync(pipe, actor) -> int:
    """The actor's full weights through the rollout pipeline's ``load_weights``, in three buckets of
    ``transformer.``-prefixed names as verl-omni's checkpoint engine sends them (peft's ``base_layer``
    spelling and the LoRA factors included: the factors take the LoRA path). Returns the native
    tensors written."""
    pairs = [(f"transformer.{name}", tensor) for name, tensor in actor.get_base_model().state_dict().items()]
    return sum(len(pipe.load_weights(pairs[i::3])) for i in range(3))


def _sync_lora(pipe, native, factors: dict, peft_config: dict, on: bool, manager):
    """The actor's LoRA update into the rollout's DiT; returns the LoRA manager for the next update.

    flowlock on: the rollout pipeline's ``map_lora_update_to_engine`` maps it and vLLM-Omni's LoRA
    manager activates the mapping, as verl-omni's worker extension does. Off: the same factors placed by
    flowlock's loader and computed by vLLM's own LoRA layers (provider mode)."""
    import flowlock
    from flowlock.integrations.verl_omni import sync
    from flowlock.integrations.vllm_omni.lora import add_lora_to_engine

    if on:
        mapped, engine_config = pipe.map_lora_update_to_engine(factors, peft_config)
        return add_lora_to_engine(native, mapped, engine_config, manager=manager)
    with flowlock.mode("provider"):
        return sync.add_lora(native, factors, peft_config, manager=manager)


def _text(seed: int) -> torch.Tensor:
    from engine_inputs import ENGINE_CONFIG

    gen = torch.Generator().manual_seed(seed)
    return torch.randn(5, ENGINE_CONFIG["text_dim"], generator=gen).to(torch.bfloat16)


def _diffuse_kwargs(seed: int, text: torch.Tensor) -> dict:
    """``diffuse``'s arguments for a t2va request, the text tags those vLLM-Omni's packer gives text rows."""
    from vllm_omni.diffusion.models.minimax_h3.packed_sequence import minimax_h3_packed_sequence

    packed = minimax_h3_packed_sequence(text_len=int(text.shape[0]), include_keyframe_cond=False, **SHAPE)
    tags = packed["token_tags"][packed["text_pos"].view(-1)].clone()
    return dict(task="t2va", text_embeddings=text, text_tags=tags, seed=seed, num_frames=5, num_steps=NUM_STEPS,
                video_shift=12.0, audio_shift=3.0, base_schedule=None, visual_condition=None,
                visual_condition_shape=None, audio_condition=None, ref_audio_t=None, **SHAPE)


def _shell(cls, native, **attributes):
    """A rollout pipeline instance holding only the DiT: the classes' ``diffuse`` needs no text encoder or
    VAE (those run in ``forward``, around it)."""
    pipe = object.__new__(cls)
    torch.nn.Module.__init__(pipe)
    pipe.transformer = native
    pipe.device = torch.device("cpu")
    for key, value in attributes.items():
        setattr(pipe, key, value)
    return pipe


def _native_velocity(native, text, video, audio, t):
    """The rollout engine's velocity (vLLM-Omni's packing) at one timestep for both modalities."""
    from vllm_omni.diffusion.models.minimax_h3.denoise_loop import MiniMaxH3DenoiseBranch
    from vllm_omni.diffusion.models.minimax_h3.packed_sequence import minimax_h3_packed_sequence

    packed = minimax_h3_packed_sequence(text_len=int(text.shape[0]), include_keyframe_cond=False, **SHAPE)
    branch = MiniMaxH3DenoiseBranch(packed=packed, text_embeddings=text, token_tags=packed["token_tags"],
                                    device=torch.device("cpu"))
    with torch.no_grad():
        return native(**branch.forward_kwargs(video_rows=video, audio_rows=audio, t_video=t, t_audio=t,
                                              imgvid_cond_timestep=t, audio_ref_cond_timestep=t))


def _nft(on: bool, args) -> dict:
    from verl_omni.pipelines.minimax_h3_diffusion_nft.common import pack_video_audio_rows
    from verl_omni.pipelines.model_base import DiffusionModelBase, VllmOmniPipelineBase

    import flowlock
    from flowlock.integrations.verl_omni import RequestNoise
    from flowlock.integrations.verl_omni.rollout import cps_rollout
    from flowlock.integrations.verl_omni.vllm_request import GRID_CONVENTION
    from flowlock.rl import h3_schedules, noise

    actor_cls = DiffusionModelBase.get_class_by_name(ARCH, "diffusion_nft")
    rollout_cls = VllmOmniPipelineBase.get_class(ARCH, "diffusion_nft")
    actor, native, lora = _models(seed=11)
    cfg = types.SimpleNamespace(pipeline={"num_inference_steps": NUM_STEPS}, lora_rank=4, lora_alpha=8, lora={})
    mode = "strict" if on else "provider"
    manager, iterations = None, []
    for iteration in (1, 2):
        pipe = _shell(rollout_cls, native, _nft_capture=None, default_video_shift=12.0)
        synced = _full_sync(pipe, actor) if on and iteration == 1 else None
        dv, dx0 = 0.0, 0.0
        for i in range(args.requests):
            text, seed = _text(50 * iteration + i), 500 * iteration + i
            with flowlock.mode(mode):
                pipe.diffuse(**_diffuse_kwargs(seed, text))
            capture = pipe._nft_capture
            if on:
                video0, audio0 = capture["video_rows"], capture["audio_rows"]
                record = capture["record"]
            else:  # verl-omni's stock diffuse keeps the unpacked latents; its rows are its own packing's
                from vllm_omni.diffusion.models.minimax_h3.packed_tokens import (
                    minimax_h3_pack_audio_latent,
                    minimax_h3_patchify_video_latent,
                )

                video0 = minimax_h3_patchify_video_latent(capture["video_latent"], patch_size=(1, 2, 2))
                audio0 = minimax_h3_pack_audio_latent(capture["audio_latent"])
                record = None
            nv, na = video0.shape[0], audio0.shape[0]
            sigmas = h3_schedules(NUM_STEPS, convention=GRID_CONVENTION).video_sigmas
            sigma = sigmas[1]  # a training timestep of the pool (sigmas[:-1] * 1000)
            eps_v = noise(seed, i, 0, "video", (nv, video0.shape[1]))
            eps_a = noise(seed, i, 0, "audio", (na, audio0.shape[1]))
            x_video, x_audio = (1 - sigma) * video0 + sigma * eps_v, (1 - sigma) * audio0 + sigma * eps_a
            latents = pack_video_audio_rows(x_video, x_audio)
            meta = torch.tensor([[nv, na, SHAPE["latent_t"], SHAPE["latent_h"], SHAPE["latent_w"], SHAPE["audio_t"]]])
            micro_batch = {"latent_meta": meta, **({} if record is None else
                                                   {k: record[k] for k in record if k.startswith("h3_")})}
            with flowlock.mode(mode), torch.no_grad():
                inputs, _ = actor_cls.prepare_model_inputs(
                    actor, cfg, latents, (sigma * 1000.0).reshape(1), text[None], torch.ones(1, 5, dtype=torch.long),
                    None, None, micro_batch, 0)
                actor_v = actor_cls.forward(actor, cfg, inputs)
                rollout_v = pack_video_audio_rows(*(-v for v in _native_velocity(native, text, x_video, x_audio,
                                                                                 float(1 - sigma))))
            dv = max(dv, float((actor_v.float() - rollout_v.float()).abs().max()))
            if on:  # the actor regenerates the clean sample from the recorded key alone
                key = RequestNoise.from_record(record, 0)
                kwargs = {k: record[k][0] for k in ("h3_token_tags", "h3_position_ids", "h3_video_indices",
                                                     "h3_audio_indices", "h3_text_indices")}
                seq_len = int(record["h3_seq_len"][0])
                rows = torch.zeros(seq_len, dtype=torch.long)
                rows[kwargs["h3_audio_indices"]] = 1

                def velocity(v, a, tv, ta, kwargs=kwargs, seq_len=seq_len, rows=rows, text=text):
                    with flowlock.mode("strict"):
                        out = actor(hidden_states=v[None], audio_hidden_states=a[None],
                                    encoder_hidden_states=text[None], timestep=torch.tensor([tv, ta]),
                                    timestep_indices=rows, token_tags=kwargs["h3_token_tags"][:seq_len],
                                    position_ids=kwargs["h3_position_ids"][:seq_len],
                                    video_indices=kwargs["h3_video_indices"],
                                    audio_indices=kwargs["h3_audio_indices"],
                                    text_indices=kwargs["h3_text_indices"][:5], return_dict=False)
                    return out[0][0], out[1][0]

                regenerated = cps_rollout(velocity, key, rows=(nv, na), row_widths=(video0.shape[1], audio0.shape[1]),
                                          schedules=h3_schedules(NUM_STEPS, convention=GRID_CONVENTION), selected=(),
                                          eta=ETA)
                dx0 = max(dx0, float((regenerated.video - video0).abs().max()),
                          float((regenerated.audio - audio0).abs().max()))
        iterations.append({"iteration": iteration, "max_abs_dv": dv, **({"max_abs_dx0": dx0} if on else {}),
                           **({"full_sync_tensors": synced} if synced is not None else {})})
        manager = _sync_lora(pipe, native, _lora_update(actor, iteration), lora.to_dict(), on, manager)
    return {"algorithm": "diffusion_nft", "actor_class": f"{actor_cls.__module__}.{actor_cls.__qualname__}",
            "rollout_class": f"{rollout_cls.__module__}.{rollout_cls.__qualname__}", "iterations": iterations}


def _flow_grpo(on: bool, args) -> dict:
    from omegaconf import OmegaConf
    from verl_omni.pipelines.model_base import DiffusionModelBase, VllmOmniPipelineBase

    import flowlock

    actor_cls = DiffusionModelBase.get_class_by_name(ARCH, "flow_grpo")
    rollout_cls = VllmOmniPipelineBase.get_class(ARCH, "flow_grpo")
    actor, native, lora = _models(seed=12)
    cfg = OmegaConf.create({"pipeline": {"num_inference_steps": NUM_STEPS}, "algo": {"noise_level": ETA,
                            "sde_type": "cps"}, "lora_rank": 4, "lora_alpha": 8, "lora": {}})
    from verl_omni.pipelines.schedulers import FlowMatchSDEDiscreteScheduler

    # build_scheduler places the grids on verl's device name, "cuda" on this CPU host: the same pair, on the CPU
    scheduler = (FlowMatchSDEDiscreteScheduler(), FlowMatchSDEDiscreteScheduler())
    actor_cls.set_timesteps(scheduler, cfg, "cpu")
    mode = "strict" if on else "provider"
    state = dict(_flow_grpo_noise_level=ETA, _flow_grpo_sde_type="cps", _flow_grpo_window_size=2,
                 _flow_grpo_window_range=None, _flow_grpo_sde_contiguous=True, _flow_grpo_seed=42,
                 _flow_grpo_trajectory={}, _h3_max_text_len=8)
    manager, iterations = None, []
    for iteration in (1, 2):
        pipe = _shell(rollout_cls, native, **state)
        synced = _full_sync(pipe, actor) if on and iteration == 1 else None
        records = []
        for i in range(args.requests):
            with flowlock.mode(mode):
                pipe.diffuse(**_diffuse_kwargs(500 * iteration + i, _text(50 * iteration + i)))
            records.append(dict(pipe._flow_grpo_trajectory))
        batch = {k: torch.cat([r[k] for r in records]) for k in records[0]}
        worst, ratios = 0.0, []
        for rows in [[i] for i in range(args.requests)] + [list(range(args.requests))]:
            micro_batch = {k: v[rows] for k, v in batch.items()}
            for k in range(micro_batch["all_log_probs"].shape[1]):
                with flowlock.mode(mode), torch.no_grad():
                    inputs, negative = actor_cls.prepare_model_inputs(
                        actor, cfg, micro_batch["all_latents"], micro_batch["all_timesteps"],
                        micro_batch["prompt_embeds"], micro_batch["prompt_embeds_mask"], None, None, micro_batch, k)
                    log_prob = actor_cls.forward_and_sample_previous_step(actor, scheduler, cfg, inputs, negative,
                                                                          micro_batch, k)[0]
                old = micro_batch["all_log_probs"][:, k]
                worst = max(worst, float((log_prob - old).abs().max()))
                ratios.append(torch.exp(log_prob.double() - old.double()))
        ratio = torch.cat(ratios)
        iterations.append({"iteration": iteration, **({"full_sync_tensors": synced} if synced is not None else {}),
                           "max_abs_dlogp": worst, "ratio_min": float(ratio.min()),
                           "ratio_max": float(ratio.max()),
                           "clip_fraction": float(((ratio - 1).abs() > CLIP).double().mean()),
                           "replays": int(ratio.numel())})
        manager = _sync_lora(pipe, native, _lora_update(actor, iteration), lora.to_dict(), on, manager)
    return {"algorithm": "flow_grpo", "actor_class": f"{actor_cls.__module__}.{actor_cls.__qualname__}",
            "rollout_class": f"{rollout_cls.__module__}.{rollout_cls.__qualname__}", "iterations": iterations}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--requests", type=int, default=2)
    parser.add_argument("--flowlock", choices=["on", "off"], required=True)
    args = parser.parse_args(argv)
    vllm_omni_env.ensure_runtime()
    on = args.flowlock == "on"
    from flowlock.integrations.vllm_omni import plugin

    os.environ[plugin.SWITCH_ENV] = "strict" if on else "off"
    plugin.register()
    if on:
        import flowlock.integrations.verl_omni.register  # noqa: F401  (verl-omni's external_lib import)
    from verl_omni.pipelines.model_base import VllmOmniPipelineBase

    runs = [_nft(on, args)]
    # verl-omni checkouts before its H3 FlowGRPO (the 2026-08-22 snapshot) register no flow_grpo H3 classes
    if VllmOmniPipelineBase.get_class(ARCH, "flow_grpo") is not None:
        runs.append(_flow_grpo(on, args))
    payload = {"flowlock": args.flowlock, "verl_omni_commit": _verl_omni_commit(), "num_steps": NUM_STEPS,
               "eta": ETA, "clip": CLIP, "requests": args.requests, "runs": runs}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"verl_omni_h3_run_{args.flowlock}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
