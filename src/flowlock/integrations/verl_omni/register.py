"""verl-omni's ``external_lib`` target: flowlock's strict MiniMax-H3 adapters, registered over verl-omni's.

Set ``actor_rollout_ref.model.external_lib=flowlock.integrations.verl_omni.register`` and
``actor_rollout_ref.rollout.external_lib=flowlock.integrations.verl_omni.register`` (and
``FLOWLOCK_VLLM_OMNI=strict`` in the rollout workers' environment). verl-omni imports this module
before it looks an adapter up; each class below subclasses verl-omni's own H3 adapter and registers
under the same ``("MiniMaxH3Pipeline", algorithm)`` key, which replaces the built-in registration.
Only the algorithms this verl-omni ships are registered: DiffusionNFT (``diffusion_nft``) and, where
verl-omni has it, FlowGRPO (``flow_grpo``).

What changes against verl-omni's adapters (everything else is inherited):

* actor: the transformer verl-omni hands over (after its Ulysses and FSDP2 wrapping) is put on
  flowlock's strict path on first use and checked by identity on every call
  (:func:`~flowlock.integrations.verl_omni.actor.strict_transformer`); FlowGRPO's replay is
  :func:`~flowlock.integrations.verl_omni.actor.replay` (flowlock's CPS transitions and fixed-order
  reductions); DiffusionNFT's forward runs one strict forward per sample on the layout the rollout
  recorded.
* weight sync: full weights and unmerged LoRA reach the rollout's DiT bitwise through
  :mod:`flowlock.integrations.verl_omni.sync` (fail-closed); ``lora.merge=True`` is refused by the actor.
* rollout: ``diffuse`` samples with :func:`~flowlock.integrations.verl_omni.vllm_request.sample_request`
  (keyed starting rows and noise, flowlock's CPS steps, the worker's strict DiT) and the record
  carries the layout and the noise keys. One request per forward: the strict pipelines do not take
  vLLM-Omni's step execution or request batching.

Importing this module needs verl-omni (and so vLLM-Omni); ``flowlock.integrations.verl_omni`` itself
never imports it.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

try:
    from verl_omni.pipelines.model_base import DiffusionModelBase, VllmOmniPipelineBase
except ImportError as err:
    raise ImportError("flowlock.integrations.verl_omni.register is verl-omni's external_lib target and needs "
                      f"verl-omni installed ({err})") from err

from flowlock.integrations.verl_omni import actor, sync, vllm_request
from flowlock.integrations.verl_omni.noise import RequestNoise
from flowlock.integrations.verl_omni.rollout import sde_window
from flowlock.rl.minimax_h3 import h3_schedules

ARCHITECTURE = "MiniMaxH3Pipeline"
# The record fields the strict rollout adds for the actor: the layout as vLLM-Omni packed it, the noise key.
LAYOUT_FIELDS = ("h3_seq_len", "h3_video_rows", "h3_audio_rows", "h3_position_ids", "h3_token_tags",
                 "h3_video_indices", "h3_audio_indices", "h3_text_indices", "flowlock_noise_seed",
                 "flowlock_noise_sample_id")


def _optional(module: str):
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name is not None and module.startswith(err.name):
            return None
        raise


def _request(kwargs: dict[str, Any]) -> vllm_request.H3Request:
    task = str(kwargs.get("task", "t2va"))
    if task != "t2va":
        raise NotImplementedError(f"the strict H3 rollout samples t2va requests only, got task={task!r}: condition "
                                  "rows (FL2VA, Ref2VA) are not carried to the actor's replay yet")
    for name in ("visual_condition", "audio_condition", "ref_blocks"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"the strict H3 rollout refuses {name}: condition rows are not replayed yet")
    return vllm_request.H3Request(
        text_embeddings=kwargs["text_embeddings"], text_tags=kwargs.get("text_tags"),
        latent_t=int(kwargs["latent_t"]), latent_h=int(kwargs["latent_h"]), latent_w=int(kwargs["latent_w"]),
        audio_t=int(kwargs["audio_t"]), num_steps=int(kwargs["num_steps"]),
        video_shift=float(kwargs["video_shift"]), audio_shift=float(kwargs["audio_shift"]))


def _latents(transformer, request: vllm_request.H3Request, video_rows: torch.Tensor, audio_rows: torch.Tensor):
    """The final rows as the latents vLLM-Omni's decoder takes (its own unpacking)."""
    from vllm_omni.diffusion.models.minimax_h3.packed_tokens import (
        minimax_h3_unpack_audio_tokens,
        minimax_h3_unpatchify_video_tokens,
    )

    arch = transformer.arch
    pt, ph, pw = (int(p) for p in arch.patch_size)
    video = minimax_h3_unpatchify_video_tokens(
        video_rows, latent_shape=(request.latent_t // pt, request.latent_h // ph, request.latent_w // pw,
                                  int(arch.latents_dim)), patch_size=(pt, ph, pw))
    audio_channels = 2
    audio = minimax_h3_unpack_audio_tokens(audio_rows, audio_t=request.audio_t * audio_channels,
                                           audio_channel=audio_channels)
    return video, audio


def _check_lora(model_config) -> None:
    merge = bool((getattr(model_config, "lora", None) or {}).get("merge", False))
    problems = actor.lora_config_refusals(rank=int(model_config.lora_rank), alpha=float(model_config.lora_alpha),
                                          merge=merge)
    if problems:
        raise ValueError("the strict H3 actor refuses this LoRA config: " + "; ".join(problems))


def _record_view(micro_batch, **fields) -> dict:
    """The micro-batch's fields with the engine's prepared tensors in place of the raw ones."""
    view = {key: micro_batch[key] for key in micro_batch.keys()}
    view.update({key: value for key, value in fields.items() if value is not None})
    return view


class _StrictWeightSync:
    """The rollout side of verl-omni's weight sync through :mod:`flowlock.integrations.verl_omni.sync`:
    full weights bucket by bucket (:class:`~flowlock.integrations.verl_omni.sync.RolloutSyncs`, other
    components to verl-omni's loader), LoRA updates mapped onto the native layers flowlock computes
    strictly (:func:`~flowlock.integrations.verl_omni.sync.map_lora_update`)."""

    def load_weights(self, weights):
        syncs = getattr(self, "_flowlock_syncs", None)
        if syncs is None:
            syncs = self._flowlock_syncs = sync.RolloutSyncs(self.transformer)
        written, others = syncs.load(weights)
        return written | (set(super().load_weights(others)) if others else set())

    def map_lora_update_to_engine(self, tensors, peft_config):
        return sync.map_lora_update(self.transformer, tensors, peft_config)


_nft = _optional("verl_omni.pipelines.minimax_h3_diffusion_nft")
_grpo = _optional("verl_omni.pipelines.minimax_h3_flow_grpo")

if _nft is not None:
    from verl_omni.pipelines.minimax_h3_diffusion_nft.common import h3_velocity_to_flow_match, pack_video_audio_rows
    from vllm_omni.diffusion.models.minimax_h3.pipeline_minimax_h3 import MiniMaxH3Pipeline

    @DiffusionModelBase.register(ARCHITECTURE, algorithm="diffusion_nft")
    class StrictMiniMaxH3DiffusionNFT(_nft.MiniMaxH3DiffusionNFT):
        """verl-omni's H3 DiffusionNFT actor with one strict forward per sample on the rollout's layout."""

        @classmethod
        def validate_lora_config(cls, model_config) -> None:
            super().validate_lora_config(model_config)
            _check_lora(model_config)

        @classmethod
        def prepare_model_inputs(cls, module, model_config, latents, timesteps, prompt_embeds, prompt_embeds_mask,
                                 negative_prompt_embeds, negative_prompt_embeds_mask, micro_batch, step):
            inputs, negative = super().prepare_model_inputs(
                module, model_config, latents, timesteps, prompt_embeds, prompt_embeds_mask, negative_prompt_embeds,
                negative_prompt_embeds_mask, micro_batch, step)
            missing = [key for key in LAYOUT_FIELDS[:8] if key not in micro_batch.keys()]
            if missing:
                raise KeyError(f"the DiffusionNFT record has no {missing}: the rollout did not run flowlock's strict "
                               "pipeline (set rollout.external_lib=flowlock.integrations.verl_omni.register)")
            inputs["flowlock_layout"] = {key: micro_batch[key] for key in LAYOUT_FIELDS[:8]}
            return inputs, negative

        @classmethod
        def forward(cls, module, model_config, model_inputs, negative_model_inputs=None):
            del negative_model_inputs
            module = actor.strict_transformer(module)
            layout = model_inputs["flowlock_layout"]
            text_len = model_inputs["encoder_mask"].long().sum(dim=1).tolist()
            timestep = model_inputs["timestep"]
            velocities = []
            for index in range(model_inputs["video_rows"].shape[0]):
                kwargs = actor.nft_sample_inputs(layout, index, int(text_len[index]))
                video, audio = module(
                    hidden_states=model_inputs["video_rows"][index:index + 1],
                    audio_hidden_states=model_inputs["audio_rows"][index:index + 1],
                    encoder_hidden_states=model_inputs["encoder_hidden_states"][index:index + 1, :int(text_len[index])],
                    timestep=timestep[index:index + 1].float(), return_dict=False, **kwargs)
                velocities.append(pack_video_audio_rows(h3_velocity_to_flow_match(video),
                                                        h3_velocity_to_flow_match(audio)))
            return torch.cat(velocities, dim=0)

    @VllmOmniPipelineBase.register(ARCHITECTURE, algorithm="diffusion_nft")
    class StrictMiniMaxH3DiffusionNFTPipeline(_StrictWeightSync, _nft.MiniMaxH3DiffusionNFTPipeline):
        """verl-omni's H3 DiffusionNFT rollout with flowlock's deterministic sampler on the strict DiT."""

        supports_request_batch = False
        supports_step_execution = False

        def diffuse(self, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            request = _request(kwargs)
            transformer = self._transformer_for_task("t2va")
            result, layout = vllm_request.sample_request(
                transformer, request, RequestNoise(int(kwargs["seed"]), 0), selected=(), eta=0.0,
                max_text_len=int(request.text_embeddings.shape[0]))
            self._nft_capture = {
                "num_steps": request.num_steps, "video_shift": request.video_shift, "latent_t": request.latent_t,
                "latent_h": request.latent_h, "latent_w": request.latent_w, "audio_t": request.audio_t,
                "video_rows": result.video, "audio_rows": result.audio, "text_embeddings": request.text_embeddings,
                "record": {**layout, **result.record},
            }
            return _latents(transformer, request, result.video, result.audio)

        def forward(self, request: Any):
            from verl_omni.pipelines.diffusion_rollout_output import with_rollout_data

            self._ensure_prompt_text(request)
            try:
                output = MiniMaxH3Pipeline.forward(self, request)
            finally:
                self._h3_prompt_ids = None
            capture, self._nft_capture = self._nft_capture, None
            if capture is None:
                return output
            record = capture["record"]
            return with_rollout_data(
                output,
                prompt_embeddings={"prompt_embeds": record["prompt_embeds"],
                                   "prompt_embeds_mask": record["prompt_embeds_mask"]},
                rl={"latents_clean": pack_video_audio_rows(capture["video_rows"], capture["audio_rows"]).float(),
                    "train_timesteps": self._build_train_timesteps(capture).unsqueeze(0),
                    "latent_meta": record["latent_meta"], **{key: record[key] for key in LAYOUT_FIELDS}},
                to_cpu=True)

if _grpo is not None:

    @DiffusionModelBase.register(ARCHITECTURE, algorithm="flow_grpo")
    class StrictMiniMaxH3FlowGRPO(_grpo.MiniMaxH3FlowGRPO):
        """verl-omni's H3 FlowGRPO actor replaying each transition with flowlock's strict forward and CPS."""

        @classmethod
        def validate_lora_config(cls, model_config) -> None:
            super().validate_lora_config(model_config)
            _check_lora(model_config)

        @classmethod
        def prepare_model_inputs(cls, module, model_config, latents, timesteps, prompt_embeds, prompt_embeds_mask,
                                 negative_prompt_embeds, negative_prompt_embeds_mask, micro_batch, step):
            record = _record_view(micro_batch, all_latents=latents, all_timesteps=timesteps,
                                  prompt_embeds=prompt_embeds, prompt_embeds_mask=prompt_embeds_mask)
            return {"flowlock_replay": actor.replay_inputs(
                module, record, step, num_inference_steps=model_config.pipeline.num_inference_steps)}, None

        @classmethod
        def forward_and_sample_previous_step(cls, module, scheduler, model_config, model_inputs,
                                             negative_model_inputs, scheduler_inputs, step):
            del scheduler, negative_model_inputs, scheduler_inputs, step
            return actor.replay(module, model_inputs["flowlock_replay"], eta=model_config.algo.noise_level,
                                sde_type=model_config.algo.sde_type).as_tuple()

    @VllmOmniPipelineBase.register(ARCHITECTURE, algorithm="flow_grpo")
    class StrictMiniMaxH3PipelineWithLogProb(_StrictWeightSync, _grpo.MiniMaxH3PipelineWithLogProb):
        """verl-omni's H3 FlowGRPO rollout with flowlock's keyed noise and CPS steps on the strict DiT."""

        supports_request_batch = False
        supports_step_execution = False

        def diffuse(self, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            if self._flow_grpo_sde_type != "cps":
                raise ValueError(f"the strict H3 rollout samples CPS transitions only, got sde_type="
                                 f"{self._flow_grpo_sde_type!r}")
            request = _request(kwargs)
            transformer = self._transformer_for_task("t2va")
            window = self._flow_grpo_window_range
            transitions = h3_schedules(request.num_steps, convention=vllm_request.GRID_CONVENTION).num_transitions
            selected = sde_window(transitions, window_size=self._flow_grpo_window_size,
                                  window_range=None if window is None else tuple(window),
                                  contiguous=self._flow_grpo_sde_contiguous, seed=self._flow_grpo_seed)
            result, layout = vllm_request.sample_request(
                transformer, request, RequestNoise(int(kwargs["seed"]), 0), selected=selected,
                eta=self._flow_grpo_noise_level, max_text_len=self._h3_max_text_len)
            if not result.record.get("all_log_probs", torch.empty(0)).numel():
                raise RuntimeError("the strict H3 rollout selected no stochastic transition")
            self._flow_grpo_trajectory = {**result.record, **layout}
            return _latents(transformer, request, result.video, result.audio)
