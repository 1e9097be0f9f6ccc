"""The strict actor side of verl-omni's H3 runs: the module verl-omni's FSDP engine hands the adapter,
put on flowlock's strict path once, and the FlowGRPO-CPS replay in verl-omni's return contract.

verl-omni builds the diffusers ``MiniMaxH3Transformer3DModel``, applies diffusers' Ulysses
(``enable_parallelism``) and FSDP2 (``fully_shard``), and then calls the registered adapter's class
methods with that module on every micro-batch. flowlock's patch is applied there, on first use
(:func:`strict_transformer`): after the wrapping, as flowlock's exact-layout checks apply it, and
without a hook in verl-omni's engine. Every later call checks, by identity, that the module's
forward is still flowlock's: verl-omni's packed multi-sample forward (``enable_packed_forward`` in
newer versions) replaces ``transformer.forward`` at run time, and a replaced forward is refused by
name instead of silently running stock.

Nothing here imports verl-omni; :mod:`flowlock.integrations.verl_omni.register` (verl-omni's
``external_lib`` target) calls it.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

import flowlock
from flowlock.integrations.verl_omni.record import ReplayResult, ReplayStep, replay_log_prob, replay_step, row_widths
from flowlock.patching import PatchHandle, active_patch
from flowlock.rl.minimax_h3 import H3Schedules, h3_schedules

# The rollout's grids are vLLM-Omni's, counted in evaluations (verl-omni's ``num_inference_steps``).
GRID_CONVENTION = "evaluations"

_handles: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class ForwardReplacedError(RuntimeError):
    """The strict transformer's forward was replaced after flowlock patched it."""


def _patch_target(module: nn.Module) -> nn.Module:
    """The model flowlock patches: a peft ``PeftModel``'s base model, else ``module`` itself."""
    return module.get_base_model() if callable(getattr(module, "get_base_model", None)) else module


def strict_transformer(module: nn.Module, *, mode: str = "strict") -> nn.Module:
    """Patch ``module`` (a diffusers H3 transformer, wrapped or not; a peft ``PeftModel``'s base model,
    which verl-omni's LoRA actor wraps) with ``flowlock.patch`` the first time it is seen (a module the
    caller already patched keeps that patch and its mode), and check on every call that its forwards
    are still the patched ones.

    Returns ``module``. Raises ``ForwardReplacedError`` when someone replaced the patched forward (verl-omni's
    ``enable_packed_forward``: the packed multi-sample forward is not served on the strict path; the
    strict adapters run one forward per sample, which gives each sample the bits it has alone), and
    whatever ``flowlock.patch`` raises for a module it cannot serve.
    """
    target = _patch_target(module)
    handle = _handles.get(target)
    if handle is None or not handle.active:
        handle = active_patch(target) or flowlock.patch(target, mode=mode)
        _handles[target] = handle
    overwritten = handle.overwritten()
    if overwritten:
        names = ", ".join(f"{name or '<root>'}.{attribute}" for name, attribute in overwritten)
        raise ForwardReplacedError(
            f"{names} no longer hold flowlock's strict forwards (something replaced them after the patch, e.g. "
            "verl-omni's enable_packed_forward); the strict adapters do not serve verl-omni's packed multi-sample "
            "forward: they run one forward per sample")
    return module


def strict_handle(module: nn.Module) -> PatchHandle | None:
    """The patch :func:`strict_transformer` made on ``module`` (its peft base model), or None."""
    return _handles.get(_patch_target(module))


def actor_schedules(num_inference_steps: int) -> H3Schedules:
    """The actor's H3 grids for verl-omni's ``pipeline.num_inference_steps`` (the rollout's, shifts 12 / 3)."""
    return h3_schedules(int(num_inference_steps), convention=GRID_CONVENTION)


@dataclass(frozen=True)
class ReplayOutputs:
    """verl-omni's ``forward_and_sample_previous_step`` outputs for H3 FlowGRPO, from flowlock's replay.

    ``log_prob (B,)``: the joint 0.5 · video + 0.5 · audio CPS log-prob. ``mean (B, 1, W)``: the video
    and audio transition means, flattened and joined like the record's latents. ``std (B, 1, 1)``: the
    element-weighted RMS of the two modalities' standard deviations. ``sqrt_dt (B,)``: the element-weighted
    RMS of ``sqrt(σ - σ')``. All float32.
    """

    log_prob: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    sqrt_dt: torch.Tensor

    def as_tuple(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.log_prob, self.mean, self.std, self.sqrt_dt


def replay_outputs(result: ReplayResult, sigma_video: torch.Tensor, sigma_video_next: torch.Tensor,
                   sigma_audio: torch.Tensor, sigma_audio_next: torch.Tensor) -> ReplayOutputs:
    """Assemble :class:`ReplayOutputs` from a replay's two transitions (weights: each modality's element count
    per sample)."""
    video, audio = result.video, result.audio
    batch = video.mean.shape[0]
    wv, wa = video.mean[0].numel(), audio.mean[0].numel()
    total = wv + wa
    mean = torch.cat([video.mean.reshape(batch, -1), audio.mean.reshape(batch, -1)], dim=1)[:, None]
    std = torch.sqrt((wv * video.std.square() + wa * audio.std.square()) / total).reshape(batch, 1, 1)
    dt = (wv * (sigma_video - sigma_video_next) + wa * (sigma_audio - sigma_audio_next)) / total
    return ReplayOutputs(result.log_prob, mean, std, torch.sqrt(dt))


def replay_inputs(module: nn.Module, micro_batch: Mapping, transition: int, *,
                  num_inference_steps: int) -> ReplayStep:
    """The inputs of the strict replay of selected transition ``transition`` of a verl-omni H3 FlowGRPO
    micro-batch: :func:`replay_step` on the actor's grids, every field checked before anything runs.

    ``micro_batch``: the record fields (see :mod:`flowlock.integrations.verl_omni.record`), as
    verl-omni's engine passes them (its prompt embeddings already cut or padded).
    """
    return replay_step(micro_batch, transition, actor_schedules(num_inference_steps), row_widths=row_widths(module))


def replay(module: nn.Module, step: ReplayStep, *, eta: float, sde_type: str = "cps") -> ReplayOutputs:
    """One strict forward of ``module`` (patched on first use) and flowlock's CPS steps against the stored
    next samples, in verl-omni's output contract. Only ``sde_type="cps"`` is exact here: the strict
    rollout samples with CPS, another flavour would not replay it."""
    if sde_type != "cps":
        raise ValueError(f"the strict H3 FlowGRPO replay computes CPS transitions only (sde_type='cps'), got "
                         f"{sde_type!r}")
    result = replay_log_prob(strict_transformer(module), step, eta=eta)
    return replay_outputs(result, step.sigma_video, step.sigma_video_next, step.sigma_audio, step.sigma_audio_next)


def nft_sample_inputs(layout: Mapping, index: int, text_len: int) -> dict[str, torch.Tensor]:
    """The layout keyword arguments of sample ``index``'s DiffusionNFT forward, from the record's ``h3_*``
    fields as the strict rollout wrote them (vLLM-Omni's own packing, so the actor's rotary positions are
    the rollout's), with every row at the one timestep NFT trains on (``timestep_indices`` all 0).
    Raises ``ValueError`` when the text length disagrees with the recorded layout."""
    seq_len = int(layout["h3_seq_len"].reshape(-1)[index])
    nv = int(layout["h3_video_rows"].reshape(-1)[index])
    na = int(layout["h3_audio_rows"].reshape(-1)[index])
    if nv + na + text_len != seq_len:
        raise ValueError(f"sample {index}: {text_len} text rows do not complete the recorded layout "
                         f"({nv} video + {na} audio of {seq_len} rows)")
    device = layout["h3_token_tags"].device
    return {
        "timestep_indices": torch.zeros(seq_len, dtype=torch.long, device=device),
        "token_tags": layout["h3_token_tags"][index, :seq_len].long(),
        "position_ids": layout["h3_position_ids"][index, :seq_len],
        "video_indices": layout["h3_video_indices"][index, :nv].long(),
        "audio_indices": layout["h3_audio_indices"][index, :na].long(),
        "text_indices": layout["h3_text_indices"][index, :text_len].long(),
    }


def lora_config_refusals(*, rank: int, alpha: float, merge: bool) -> list[str]:
    """Why a verl-omni actor LoRA config (``model.lora_rank``, ``model.lora_alpha``, ``model.lora.merge``)
    cannot give the rollout the actor's bits (empty: it can). Target modules, dropout and the other
    peft options are checked against the rollout model at sync time
    (:func:`flowlock.integrations.verl_omni.sync.lora_config_problems`)."""
    if rank <= 0:
        return []
    problems = []
    scale = alpha / rank
    if not (scale > 0 and math.isfinite(scale) and math.frexp(scale)[0] == 0.5):
        problems.append(f"lora_alpha / lora_rank = {alpha:g} / {rank} is not a power of two: the rollout folds the "
                        "scale into lora_B, which would round B")
    if merge:
        problems.append("lora.merge=True sends merged weights to the rollout while the actor trains (and replays) "
                        "the unmerged LoRA: the two round differently; use unmerged LoRA sync")
    return problems
