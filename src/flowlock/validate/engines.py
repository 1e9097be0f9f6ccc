"""The RL loop across engines: sample in vLLM-Omni, replay in diffusers, and find where they part.

:func:`run_engine_consistency` is the main job of an RL step with the two real engines. A rollout
lays ``n`` requests out with vLLM-Omni's own packer (each padded to its 64-row alignment), runs
them through ``MiniMaxH3DiTModel`` (all packed into one forward per step; the stock path packs
only where vLLM-Omni's attention isolates requests, its own rule, else one request per forward)
and takes the video and audio CPS transitions with counter-based noise; the trainer then replays
every request alone in diffusers (:func:`flowlock.integrations.vllm_omni.minimax_h3.replay.diffusers_requests`
of the stored forward kwargs, requests in reversed order, autograd recording) with the stored
next latents as targets.
Exactly on-policy means every replayed velocity and log-prob has the rollout's bits.

:func:`trace_engines` runs one request through both engines with a forward hook on every module
and names the first module (in the trainer's order, diffusers names) whose output differs.

Both take the two models already set up for the mode they run: ``"strict"`` expects ``flowlock.patch``
on the diffusers model and ``flowlock.integrations.vllm_omni.install`` on the native one;
``"provider"`` runs each engine's stock forward (patched or not).
"""

from __future__ import annotations

import re

import torch

import flowlock
from flowlock.rl.minimax_h3 import h3_schedules
from flowlock.rl.noise import initial_latents, noise
from flowlock.rl.transitions import cps_step, joint_log_prob
from flowlock.testing import mismatch_count
from flowlock.validate.report import Block, Table
from flowlock.validate.trace import capture

# vLLM-Omni's packer writes H3's row widths: 24 latent channels x (1, 2, 2) patches, 32 audio channels.
ROLLOUT_WIDTHS = {"in_channels": 24, "audio_in_channels": 32}
CONDITION_TIMESTEP, AUDIO_REFERENCE_TIMESTEP = 0.999, 1.0
# (text rows, latent t, h, w, audio rows) of the demo's requests: differing lengths, all padded to 64
SHAPES = ((5, 2, 4, 6, 4), (7, 1, 4, 6, 3), (4, 2, 2, 4, 6), (6, 1, 2, 6, 5))
# native module -> the diffusers module whose output it must equal
_NAMES = ((r"video_patch_proj", "proj_in"), (r"audio_patch_proj", "audio_proj_in"),
          (r"condition_proj", "context_embedder"),
          (r"token_refiner\.blocks\.(\d+)", r"token_refiner.refiner_blocks.\1"),
          (r"token_refiner", "token_refiner.final_norm"), (r"time_embedder", "time_embedder"),
          (r"blocks\.(\d+)", r"transformer_blocks.\1"), (r"final_layer\.video_out", "proj_out"),
          (r"final_layer\.audio_out", "audio_proj_out"))


def packed_branch(shape: tuple, text: torch.Tensor, device: torch.device, *, unpadded: bool = False):
    """One t2va request of ``shape`` ``(text rows, latent t, h, w, audio frames)`` laid out by vLLM-Omni
    (``MiniMaxH3DenoiseBranch`` over ``minimax_h3_packed_sequence``) with prompt embeddings ``text``,
    padded to its 64-row alignment unless ``unpadded`` (then each block's output has the rows of the
    diffusers block's)."""
    from vllm_omni.diffusion.models.minimax_h3.denoise_loop import MiniMaxH3DenoiseBranch
    from vllm_omni.diffusion.models.minimax_h3.packed_sequence import minimax_h3_packed_sequence

    text_len, latent_t, h, w, audio_t = shape
    layout = dict(text_len=text_len, latent_t=latent_t, latent_h=h, latent_w=w, audio_t=audio_t,
                  include_keyframe_cond=False)
    packed = minimax_h3_packed_sequence(**layout)
    if unpadded:
        packed = minimax_h3_packed_sequence(**layout, seq_len=int((packed["token_tags"] != -1).sum()))
    return MiniMaxH3DenoiseBranch(packed=packed, text_embeddings=text, token_tags=packed["token_tags"], device=device)


def _branch(shape: tuple, text_dim: int, seed: int, device: torch.device, *, unpadded: bool = False,
            dtype: torch.dtype = torch.bfloat16):
    """:func:`packed_branch` with seeded prompt embeddings in ``dtype`` (the models' own: bf16, or float32
    for all-FP32 models)."""
    gen = torch.Generator().manual_seed(seed)
    text = torch.randn(shape[0], text_dim, generator=gen).to(dtype).to(device)
    return packed_branch(shape, text, device, unpadded=unpadded)


def _forward_kwargs(branches, video, audio, t_video: float, t_audio: float) -> dict:
    from vllm_omni.diffusion.models.minimax_h3.batched_packing import minimax_h3_batched_forward_kwargs

    n = len(branches)
    return minimax_h3_batched_forward_kwargs(
        branches=branches, video_rows=video, audio_rows=audio, t_video=[t_video] * n, t_audio=[t_audio] * n,
        imgvid_cond_timesteps=[CONDITION_TIMESTEP] * n, audio_ref_cond_timesteps=[AUDIO_REFERENCE_TIMESTEP] * n)


def _stock_packs(native_model) -> bool:
    from vllm_omni.diffusion.models.minimax_h3.minimax_h3_transformer import _attention_isolates_packed_requests

    blocks = [*native_model.blocks, *native_model.token_refiner.blocks]
    return all(_attention_isolates_packed_requests(block.attn.attention) for block in blocks)


def _cps(x, v, sigma, sigma_next, eta, **target):
    full = lambda value: torch.tensor([float(value)], dtype=torch.float32, device=x.device)
    return cps_step(x[None], v[None].float(), full(sigma), full(sigma_next), eta=eta, **target)


def run_engine_consistency(diffusers_model, native_model, *, n_requests: int = 3, steps: int = 2, eta: float = 0.8,
                           seed: int = 0, mode: str) -> dict:
    """Rollout in vLLM-Omni, replay in diffusers, ``mode`` ``"strict"`` or ``"provider"``; a JSON-able report.

    ``diffusers_model``: ``MiniMaxH3Transformer3DModel`` with :data:`ROLLOUT_WIDTHS`;
    ``native_model``: the ``MiniMaxH3DiTModel`` holding the same weights (and the synced LoRA, if
    the trainer has one). Grids: H3's video / audio shifts, ``steps`` transitions. Returns per step
    ``velocity_mismatches`` / ``velocity_elements``, ``logp_mismatches`` (requests whose joint
    log-prob bits differ), ``max_abs_dlogp``, and ``bitwise_equal`` over all of it.
    """
    if mode not in ("strict", "provider"):
        raise ValueError(f"mode must be 'strict' or 'provider', got {mode!r}")
    from flowlock.integrations.vllm_omni.minimax_h3.replay import diffusers_requests

    device = next(diffusers_model.parameters()).device
    text_dtype = diffusers_model.context_embedder.weight.dtype
    branches = [_branch(SHAPES[i % len(SHAPES)], diffusers_model.config["text_dim"], seed * 1000 + i, device,
                        dtype=text_dtype)
                for i in range(n_requests)]
    ids = list(range(n_requests))
    shapes = [((b.img_pos.numel(), 96), (b.audio_pos.numel(), 32)) for b in branches]
    xv = [initial_latents(seed, [i], "video", shapes[i][0], batch=1, device=device)[0] for i in ids]
    xa = [initial_latents(seed, [i], "audio", shapes[i][1], batch=1, device=device)[0] for i in ids]
    sched = h3_schedules(steps, convention="evaluations")
    # vLLM-Omni packs requests into one forward only where its attention isolates them (its own rule);
    # flowlock's attention runs per cu_seqlens document, so the strict rollout always packs
    packs = mode == "strict" or _stock_packs(native_model)
    groups = [ids] if packs else [[i] for i in ids]
    per_step = []
    for k in range(sched.num_transitions):
        sv, sv_next = sched.video_sigmas[k], sched.video_sigmas[k + 1]
        sa, sa_next = sched.audio_sigmas[k], sched.audio_sigmas[k + 1]
        t_video, t_audio = float(sched.video_timesteps[k]), float(sched.audio_timesteps[k])
        rollout, replays = [], []
        for group in groups:
            kwargs = _forward_kwargs([branches[i] for i in group], [xv[i] for i in group], [xa[i] for i in group],
                                     t_video, t_audio)
            with torch.no_grad(), flowlock.mode(mode):
                video, audio = native_model(**kwargs)
            replays += diffusers_requests(kwargs)
            rows = zip(video.split([shapes[i][0][0] for i in group]), audio.split([shapes[i][1][0] for i in group]))
            rollout += [(i, v, a) for i, (v, a) in zip(group, rows)]
        for n, (i, v, a) in enumerate(rollout):
            step_v = _cps(xv[i], v, sv, sv_next, eta, noise=noise(seed, i, k, "video", (1, *shapes[i][0]),
                                                                  device=device))
            step_a = _cps(xa[i], a, sa, sa_next, eta, noise=noise(seed, i, k, "audio", (1, *shapes[i][1]),
                                                                  device=device))
            rollout[n] = (v, a, step_v, step_a)
        velocity_mismatches = velocity_elements = logp_mismatches = 0
        max_dlogp = 0.0
        for i in reversed(ids):
            replay = replays[i]
            # the trainer's forward records autograd, as training does
            with torch.enable_grad(), flowlock.mode(mode):
                out = diffusers_model(**replay.kwargs)
            v, a = out.sample[0], out.audio_sample[0]
            if replay.update_mask is not None:
                v = v * replay.update_mask.unsqueeze(-1)
            rv, ra, roll_v, roll_a = rollout[i]
            step_v = _cps(xv[i], v, sv, sv_next, eta, prev_sample=roll_v.next_sample)
            step_a = _cps(xa[i], a, sa, sa_next, eta, prev_sample=roll_a.next_sample)
            joint = [joint_log_prob(sv_.log_prob, sa_.log_prob, xv[i].numel(), xa[i].numel(), flavour="verl")
                     for sv_, sa_ in ((roll_v, roll_a), (step_v, step_a))]
            velocity_mismatches += mismatch_count(rv, v.detach()) + mismatch_count(ra, a.detach())
            velocity_elements += rv.numel() + ra.numel()
            logp_mismatches += int(mismatch_count(joint[0], joint[1].detach()) > 0)
            max_dlogp = max(max_dlogp, float((joint[1].detach().double() - joint[0].double()).abs().max()))
        per_step.append({"step": k, "velocity_mismatches": velocity_mismatches, "velocity_elements": velocity_elements,
                         "logp_mismatches": logp_mismatches, "max_abs_dlogp": max_dlogp})
        xv = [r[2].next_sample[0] for r in rollout]
        xa = [r[3].next_sample[0] for r in rollout]
    return {"mode": mode, "n_requests": n_requests, "transitions": sched.num_transitions, "eta": eta, "seed": seed,
            "requests_per_forward": len(groups[0]), "seq_len": int(kwargs["x"].shape[1]), "per_step": per_step,
            "bitwise_equal": all(s["velocity_mismatches"] == 0 and s["logp_mismatches"] == 0 for s in per_step)}


def _diffusers_name(native: str) -> str | None:
    for pattern, name in _NAMES:
        if re.fullmatch(pattern, native):
            return re.sub(pattern, name, native)
    return None


def _comparable(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    # diffusers keeps a batch dimension of 1 where the native model has none
    if a.shape != b.shape and b.ndim == a.ndim + 1 and b.shape[0] == 1:
        b = b[0]
    return (a, b) if a.shape == b.shape else None


def trace_engines(diffusers_model, native_model, *, mode: str, seed: int = 1) -> dict:
    """The first module whose output differs between vLLM-Omni and diffusers for one unpadded request.

    Each native module of a fixed table (patch and condition projections, refiner blocks, the
    refiner's final norm, time embedder, DiT blocks, output heads) is paired with its diffusers
    module; pairs are compared in the diffusers forward's completion order, bitwise. Returns
    ``{"compared": n, "skipped": [diffusers names whose shapes do not correspond], "divergence": None |
    {"module", "native_module", "mismatches", "numel", "max_abs_diff"}}``.
    """
    from flowlock.integrations.vllm_omni.minimax_h3.replay import diffusers_requests

    device = next(diffusers_model.parameters()).device
    # unpadded, so both engines compute over the same rows
    branch = _branch(SHAPES[0], diffusers_model.config["text_dim"], seed, device, unpadded=True,
                     dtype=diffusers_model.context_embedder.weight.dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    video = torch.randn(branch.img_pos.numel(), 96, generator=gen).to(device)
    audio = torch.randn(branch.audio_pos.numel(), 32, generator=gen).to(device)
    kwargs = _forward_kwargs([branch], [video], [audio], 0.3, 0.55)
    (replay,) = diffusers_requests(kwargs)
    return first_module_difference(diffusers_model, native_model, kwargs, replay.kwargs, mode=mode)


def first_module_difference(diffusers_model, native_model, native_kwargs: dict, diffusers_kwargs: dict, *,
                            mode: str) -> dict:
    """Run one request through both engines (``native_kwargs``: vLLM-Omni's packed forward kwargs;
    ``diffusers_kwargs``: the same request for ``MiniMaxH3Transformer3DModel``) in ``mode`` and name
    the first paired module whose output differs, in the diffusers forward's completion order."""

    def run(model, call_kwargs):
        def call():
            with flowlock.mode(mode):
                return model(**call_kwargs)
        return call

    native = {r.name: r for r in capture(native_model, run(native_model, native_kwargs))}
    trainer = capture(diffusers_model, run(diffusers_model, diffusers_kwargs))
    pairs = {_diffusers_name(name): name for name in native if _diffusers_name(name) is not None}
    compared, skipped = 0, []
    for record in trainer:
        if record.name not in pairs:
            continue
        theirs = native[pairs[record.name]]
        views = _comparable(theirs.outputs[0], record.outputs[0]) if theirs.outputs and record.outputs else None
        if views is None:
            skipped.append(record.name)
            continue
        compared += 1
        a, b = views
        if mismatch_count(a, b):
            return {"compared": compared, "skipped": skipped, "divergence": {
                "module": record.name, "native_module": pairs[record.name], "mismatches": mismatch_count(a, b),
                "numel": a.numel(), "max_abs_diff": float((a.double() - b.double()).abs().max())}}
    return {"compared": compared, "skipped": skipped, "divergence": None}


def _synced_lora(diffusers_model, native_model, rank: int = 8, seed: int = 3) -> str:
    """Give the trainer a peft LoRA with trained-looking factors and sync it into vLLM-Omni."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from flowlock.integrations.vllm_omni.lora import add_lora_to_engine, map_lora_update_to_engine
    from flowlock.models.common.peft_lora import is_peft_lora

    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["to_q", "to_k", "to_v", "to_out.0",
                                                                     "ff.net.0.proj", "ff.net.2"])
    diffusers_model.add_adapter(config)
    gen = torch.Generator().manual_seed(seed)
    for module in diffusers_model.modules():
        if is_peft_lora(module):
            for factor in (module.lora_A["default"], module.lora_B["default"]):
                # peft starts lora_B at zero; random factors stand for a trained adapter
                factor.weight.data = (torch.randn(factor.weight.shape, generator=gen) * 0.2).to(factor.weight)
    mapped, engine_config = map_lora_update_to_engine(get_peft_model_state_dict(diffusers_model), config.to_dict(),
                                                      model=native_model)
    add_lora_to_engine(native_model, mapped, engine_config)
    return f"peft LoRA r{rank}/alpha{2 * rank} on q/k/v/out/fc1/fc2, synced trainer -> rollout in memory"


def engine_demo(device: torch.device, *, dtype: torch.dtype = torch.bfloat16, n_requests: int = 3, steps: int = 2,
                lora: bool | None = None, consistency: bool = True) -> dict:
    """The cross-engine demo on the tiny H3 (random weights; ``dtype`` bf16 with H3's FP32 modules, or
    float32 throughout, vLLM-Omni's model cast to match): rollout/replay consistency (unless not
    ``consistency``) and the trace, strict (both engines under flowlock) and stock (both engines' own
    forwards), side by side. ``lora``: the trainer carries a LoRA synced into vLLM-Omni
    (:func:`_synced_lora`); by default when peft is installed, and the report's ``adapter`` says
    which. ``ok``: strict is bitwise equal across engines in all of it."""
    import importlib.util

    from flowlock.integrations.vllm_omni import install
    from flowlock.integrations.vllm_omni.runtime import native_from_diffusers
    from flowlock.models.minimax_h3 import TINY_H3_CONFIG, make_h3

    diffusers_model = make_h3({**TINY_H3_CONFIG, **ROLLOUT_WIDTHS}, seed=0, dtype=dtype, device=device)
    native_model = native_from_diffusers(diffusers_model)
    has_peft = importlib.util.find_spec("peft") is not None
    if lora is None:
        lora = has_peft
    adapter = _synced_lora(diffusers_model, native_model) if lora else (
        "no LoRA" if has_peft else "no LoRA (peft is not installed)")
    # vLLM-Omni's own forward cannot run an FP32 model: it casts the text rows (and the AdaLN input) to
    # BF16 ahead of FP32 weights, and its linears refuse the mixed dtypes
    modes = ("strict", "provider") if dtype == torch.bfloat16 else ("strict",)
    with flowlock.patch(diffusers_model, mode="strict"), install(native_model, mode="strict"):
        runs = {mode: run_engine_consistency(diffusers_model, native_model, n_requests=n_requests, steps=steps,
                                             mode=mode) for mode in modes} if consistency else None
        traces = {mode: trace_engines(diffusers_model, native_model, mode=mode) for mode in modes}
    ok = (runs is None or runs["strict"]["bitwise_equal"]) and traces["strict"]["divergence"] is None
    payload = {"device": str(device), "dtype": str(dtype).removeprefix("torch."),
               "model": "tiny H3 (random weights), diffusers and vLLM-Omni 0.30.0",
               "adapter": adapter, "consistency": runs, "trace": traces, "ok": ok}
    if "provider" not in modes:
        payload["stock"] = ("not run: vLLM-Omni's own forward casts the text rows to BF16 before condition_proj and "
                            "the AdaLN input to BF16, so it cannot run with FP32 weights")
    return payload


def _describe(trace: dict) -> str:
    div = trace["divergence"]
    if div is None:
        skipped = f"; not comparable: {', '.join(trace['skipped'])}" if trace["skipped"] else ""
        return f"no module differs ({trace['compared']} module outputs compared{skipped})"
    return (f"first module that differs: {div['module']} (vLLM-Omni {div['native_module']}), {div['mismatches']}/"
            f"{div['numel']} elements, max |diff| {div['max_abs_diff']:.3e}")


def report_blocks(payload: dict) -> list[Block]:
    """The cross-engine demo's report: per-step mismatches, strict and stock, then both traces."""
    blocks: list[Block] = [f"flowlock --rollout vllm-omni: {payload['model']} on {payload['device']}; "
                           f"{payload['adapter']}"]
    if payload["consistency"] is not None:
        blocks += _consistency_blocks(payload["consistency"]["strict"], payload["consistency"].get("provider"))
    for mode, label in (("strict", "strict"), ("provider", "stock")):
        if mode in payload["trace"]:
            blocks.append(f"trace {label:6s}: {_describe(payload['trace'][mode])}")
    if "stock" in payload:
        blocks.append(f"stock: {payload['stock']}")
    blocks.append(f"strict path exactly on-policy across engines: {'yes' if payload['ok'] else 'NO'}")
    return blocks


def _consistency_blocks(strict: dict, stock: dict | None) -> list[Block]:
    stock_forward = "not run" if stock is None else stock["requests_per_forward"]
    rows = []
    for k, s in enumerate(strict["per_step"]):
        p = None if stock is None else stock["per_step"][k]
        cells = (f"{s['velocity_mismatches']} of {s['velocity_elements']}", str(s["logp_mismatches"]),
                 f"{s['max_abs_dlogp']:.1e}")
        other = ("-", "-", "-") if p is None else (f"{p['velocity_mismatches']} of {p['velocity_elements']}",
                                                  str(p["logp_mismatches"]), f"{p['max_abs_dlogp']:.1e}")
        rows.append((str(s["step"]), *cells, *other))
    table = Table(
        f"rollout: {strict['n_requests']} requests x {strict['transitions']} CPS steps in vLLM-Omni, "
        f"{strict['requests_per_forward']} per forward strict, {stock_forward} stock (vLLM-Omni packs only where "
        "its attention isolates requests); replay: each request alone in diffusers, reversed order",
        ("step", "strict: velocity elements that differ", "strict: requests whose log-prob differs",
         "strict: max |change in log-prob|", "stock: velocity elements that differ",
         "stock: requests whose log-prob differs", "stock: max |change in log-prob|"),
        tuple(rows), right=frozenset(range(7)))
    return [table]
