"""``flowlock trace --rollout verl-omni``: one verl-omni H3 FlowGRPO rollout and its actor replay, and the
first record field, transition or module where they part.

The rollout is what flowlock's verl-omni rollout class runs in a vLLM-Omni worker
(:func:`flowlock.integrations.verl_omni.vllm_request.sample_request` on the native DiT: keyed noise, CPS
steps, the SDE window); the replay is what its actor class runs
(:func:`flowlock.integrations.verl_omni.actor.replay_inputs` / ``replay`` on the diffusers model), on
verl-omni's record format. Tiny H3, random weights, strict (both engines under flowlock) and stock (both
engines' own forwards; the sampler and replay math stay flowlock's, so any difference is the engines')
side by side. For each request and selected transition in order: a record field the actor refuses is
named; else a replayed log-prob that differs from the recorded one names the transition, and the two
engines' forwards on that transition's input are traced module by module
(:func:`flowlock.validate.engines.first_module_difference`).
"""

from __future__ import annotations

import torch

import flowlock
from flowlock.validate.engines import ROLLOUT_WIDTHS, first_module_difference, packed_branch
from flowlock.validate.report import Block

NUM_STEPS, ETA, WINDOW, MAX_TEXT = 4, 0.7, (1, 2), 8
# (text rows, latent t, latent h, latent w, audio frames) of the traced requests: one layout, as a
# verl-omni micro-batch needs
REQUEST_SHAPE = (5, 2, 4, 6, 4)


def _requests(n: int, text_dim: int, device: torch.device):
    from flowlock.integrations.verl_omni.vllm_request import H3Request

    text_len, latent_t, latent_h, latent_w, audio_t = REQUEST_SHAPE
    out = []
    for i in range(n):
        gen = torch.Generator().manual_seed(60 + i)
        text = torch.randn(text_len, text_dim, generator=gen).to(torch.bfloat16).to(device)
        out.append(H3Request(text_embeddings=text, text_tags=None, latent_t=latent_t, latent_h=latent_h,
                             latent_w=latent_w, audio_t=audio_t, num_steps=NUM_STEPS))
    return out


def _native_kwargs(request, step, device) -> dict:
    """vLLM-Omni's forward kwargs for ``request`` at the replayed transition's state and timesteps, unpadded."""
    branch = packed_branch(REQUEST_SHAPE, request.text_embeddings, device, unpadded=True)
    t_video, t_audio = (float(1.0 - s) for s in (step.sigma_video[0], step.sigma_audio[0]))
    return branch.forward_kwargs(video_rows=step.model_kwargs["hidden_states"][0],
                                 audio_rows=step.model_kwargs["audio_hidden_states"][0], t_video=t_video,
                                 t_audio=t_audio, imgvid_cond_timestep=t_video, audio_ref_cond_timestep=t_audio)


def _trace_mode(diffusers_model, native_model, requests, mode: str, device) -> dict:
    from flowlock.integrations.verl_omni import RequestNoise, actor
    from flowlock.integrations.verl_omni.vllm_request import sample_request

    replays = 0
    for i, request in enumerate(requests):
        with flowlock.mode(mode), torch.no_grad():
            result, layout = sample_request(native_model, request, RequestNoise(300 + i, i), selected=WINDOW, eta=ETA,
                                            max_text_len=MAX_TEXT)
        record = {**result.record, **layout}
        for k in range(len(WINDOW)):
            try:
                step = actor.replay_inputs(diffusers_model, record, k, num_inference_steps=NUM_STEPS)
            except (KeyError, TypeError, ValueError) as err:
                return {"replays": replays, "divergence": {"request": i, "transition": k, "field": str(err)}}
            with flowlock.mode(mode), torch.no_grad():
                out = actor.replay(diffusers_model, step, eta=ETA)
            replays += 1
            recorded = record["all_log_probs"][:, k]
            if not torch.equal(out.log_prob, recorded):
                module = first_module_difference(diffusers_model, native_model, _native_kwargs(request, step, device),
                                                 step.model_kwargs, mode=mode)
                return {"replays": replays, "divergence": {
                    "request": i, "transition": k, "grid_step": step.grid_step,
                    "max_abs_dlogp": float((out.log_prob - recorded).abs().max()), "module": module["divergence"]}}
    return {"replays": replays, "divergence": None}


def trace_verl_omni(device: torch.device, *, requests: int = 2) -> dict:
    """The trace, strict and stock. ``ok``: strict replays every recorded log-prob bitwise."""
    from flowlock.integrations.vllm_omni import install
    from flowlock.integrations.vllm_omni.runtime import native_from_diffusers
    from flowlock.models.minimax_h3 import TINY_H3_CONFIG, make_h3

    diffusers_model = make_h3({**TINY_H3_CONFIG, **ROLLOUT_WIDTHS}, seed=0, device=device)
    native_model = native_from_diffusers(diffusers_model)
    traced = _requests(requests, diffusers_model.config["text_dim"], device)
    with flowlock.patch(diffusers_model, mode="strict"), install(native_model, mode="strict"):
        runs = {mode: _trace_mode(diffusers_model, native_model, traced, mode, device)
                for mode in ("strict", "provider")}
    return {"device": str(device), "model": "tiny H3 (random weights), diffusers actor and vLLM-Omni 0.30.0 rollout",
            "sampler": f"FlowGRPO-CPS, {NUM_STEPS} steps, eta {ETA}, SDE window {list(WINDOW)}, keyed noise",
            "requests": requests, "strict": runs["strict"], "stock": runs["provider"],
            "ok": runs["strict"]["divergence"] is None}


def _line(name: str, run: dict) -> str:
    div = run["divergence"]
    if div is None:
        return f"{name}: every replayed log-prob equals the rollout's ({run['replays']} replays)"
    where = f"request {div['request']}, selected transition {div['transition']}"
    if "field" in div:
        return f"{name}: {where}: the actor refuses the record: {div['field']}"
    module = div["module"]
    first = ("no module output differs (the difference is after the forward)" if module is None else
             f"first module that differs: {module['module']} (vLLM-Omni {module['native_module']}), "
             f"{module['mismatches']}/{module['numel']} elements, max |diff| {module['max_abs_diff']:.3e}")
    return f"{name}: {where} (grid step {div['grid_step']}): |Δlogp| {div['max_abs_dlogp']:.3e}; {first}"


def report_blocks(payload: dict) -> list[Block]:
    return [f"flowlock trace --rollout verl-omni: {payload['model']} on {payload['device']}; {payload['sampler']}",
            _line("strict", payload["strict"]), _line("stock", payload["stock"])]
