"""The rollout/replay log-prob consistency run behind ``flowlock demo``.

A rollout draws ``N`` samples through ``K`` CPS transitions in one batch composition (one model
forward per step on the rollout batch, then the video and audio CPS steps), with initial latents
and noise from :mod:`flowlock.rl.noise`. A training replay then recomputes every log-prob with a
different micro-batching and sample order, feeding the stored latents and taking the stored next
latents as the transition target (no noise is regenerated). On an exactly on-policy path every
replayed log-prob has the same bits as the rollout's; the run reports how far it is from that.
"""

from __future__ import annotations

import random

import torch

import flowlock
from flowlock.models.minimax_h3 import H3Packing, tiny_inputs
from flowlock.models.minimax_h3.tiny import tiny_packing
from flowlock.rl.minimax_h3 import h3_schedules
from flowlock.rl.noise import batch_noise, initial_latents
from flowlock.rl.trajectory import Trajectory, compare
from flowlock.rl.transitions import cps_step, joint_log_prob
from flowlock.testing import mismatch_count

REPLAY_ORDERS = ("same", "reversed", "shuffled")
RUN_MODES = ("strict", "provider")


def _check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def step_batch(model, layout_kwargs, text, latents_v, latents_a, timestep, sigmas, eta, noises=None, targets=None):
    """One forward on a batch, then the video and audio CPS transitions: a rollout step when given
    ``noises`` (video, audio), a replay step scoring ``targets`` (the stored next latents) otherwise.
    Returns the velocities (fp32), the next latents and the joint verl log-prob per sample."""
    video_v, video_a = model(hidden_states=latents_v, audio_hidden_states=latents_a, encoder_hidden_states=text,
                             timestep=timestep, **layout_kwargs, return_dict=False)
    b = latents_v.shape[0]
    (sv, sv_next), (sa, sa_next) = sigmas
    full = lambda value: torch.full((b,), float(value), dtype=torch.float32, device=latents_v.device)
    kw_v = {"noise": noises[0]} if noises is not None else {"prev_sample": targets[0]}
    kw_a = {"noise": noises[1]} if noises is not None else {"prev_sample": targets[1]}
    res_v = cps_step(latents_v, video_v.float(), full(sv), full(sv_next), eta=eta, **kw_v)
    res_a = cps_step(latents_a, video_a.float(), full(sa), full(sa_next), eta=eta, **kw_a)
    lp = joint_log_prob(res_v.log_prob, res_a.log_prob, latents_v[0].numel(), latents_a[0].numel(), flavour="verl")
    return video_v.float(), video_a.float(), res_v.next_sample, res_a.next_sample, lp


def _stacked(trajectories: list[Trajectory], step: int, name: str, rows: list[int], device) -> torch.Tensor:
    return torch.stack([trajectories[i].steps[step][name] for i in rows]).to(device)


def _run(model, n_samples, steps, eta, seed, rollout_batch, replay_micro_batch, replay_order, layout):
    device = next(model.parameters()).device
    layout = layout.to(device)
    config = dict(model.config)
    inputs = tiny_inputs(n_samples, seed=seed, config=config, packing=layout, device=device)
    layout_kwargs = layout.model_kwargs()
    text = inputs["encoder_hidden_states"]
    shape_v, shape_a = tuple(inputs["hidden_states"].shape[1:]), tuple(inputs["audio_hidden_states"].shape[1:])
    sched = h3_schedules(steps, convention="evaluations")
    ids = list(range(n_samples))
    xv = initial_latents(seed, ids, "video", shape_v, batch=n_samples, device=device)
    xa = initial_latents(seed, ids, "audio", shape_a, batch=n_samples, device=device)

    rollout = [Trajectory(seed, i) for i in ids]
    for traj in rollout:
        traj.set_run("sigmas.video", sched.video_sigmas)
        traj.set_run("sigmas.audio", sched.audio_sigmas)
    replay = [Trajectory(seed, i) for i in ids]
    for a, b in zip(rollout, replay):
        b.run = dict(a.run)

    stored = []
    for k in range(sched.num_transitions):
        timestep = torch.stack([sched.video_timesteps[k], sched.audio_timesteps[k]]).to(device)
        sigmas = ((sched.video_sigmas[k], sched.video_sigmas[k + 1]),
                  (sched.audio_sigmas[k], sched.audio_sigmas[k + 1]))
        next_v, next_a = torch.empty_like(xv), torch.empty_like(xa)
        for start in range(0, n_samples, rollout_batch):
            rows = ids[start:start + rollout_batch]
            noises = (batch_noise(seed, rows, k, "video", shape_v, batch=len(rows), device=device),
                      batch_noise(seed, rows, k, "audio", shape_a, batch=len(rows), device=device))
            with torch.no_grad():
                vel_v, vel_a, nv, na, lp = step_batch(model, layout_kwargs, text[rows], xv[rows], xa[rows], timestep,
                                                      sigmas, eta, noises=noises)
            next_v[rows], next_a[rows] = nv, na
            for j, i in enumerate(rows):
                for name, t in (("latent.video", xv[i]), ("latent.audio", xa[i]), ("velocity.video", vel_v[j]),
                                ("velocity.audio", vel_a[j]), ("next.video", nv[j]), ("next.audio", na[j]),
                                ("log_prob", lp[j])):
                    rollout[i].record(k, name, t)
        stored.append((timestep, sigmas))
        xv, xa = next_v, next_a

    order = list(ids)
    if replay_order == "reversed":
        order.reverse()
    elif replay_order == "shuffled":
        random.Random(seed).shuffle(order)
    for k, (timestep, sigmas) in enumerate(stored):
        for start in range(0, n_samples, replay_micro_batch):
            rows = order[start:start + replay_micro_batch]
            lat_v, lat_a, tgt_v, tgt_a = (_stacked(rollout, k, name, rows, device) for name in
                                          ("latent.video", "latent.audio", "next.video", "next.audio"))
            # Training runs with autograd recording; replay does too, so its forward is the trainer's.
            with torch.enable_grad():
                vel_v, vel_a, nv, na, lp = step_batch(model, layout_kwargs, text[rows], lat_v, lat_a, timestep,
                                                      sigmas, eta, targets=(tgt_v, tgt_a))
            for j, i in enumerate(rows):
                for name, t in (("latent.video", lat_v[j]), ("latent.audio", lat_a[j]),
                                ("velocity.video", vel_v[j]), ("velocity.audio", vel_a[j]),
                                ("next.video", nv[j]), ("next.audio", na[j]), ("log_prob", lp[j])):
                    replay[i].record(k, name, t)
    return sched, rollout, replay


def _report(sched, rollout, replay) -> list[dict]:
    per_step = []
    for k in range(sched.num_transitions):
        lp_r = torch.stack([t.steps[k]["log_prob"] for t in rollout])
        lp_t = torch.stack([t.steps[k]["log_prob"] for t in replay])
        delta = lp_t.double() - lp_r.double()
        vel_mismatch = vel_total = 0
        for a, b in zip(rollout, replay):
            for name in ("velocity.video", "velocity.audio"):
                vel_mismatch += mismatch_count(a.steps[k][name], b.steps[k][name])
                vel_total += a.steps[k][name].numel()
        per_step.append({
            "step": k,
            "sigma_video": float(sched.video_sigmas[k]),
            "sigma_audio": float(sched.audio_sigmas[k]),
            "max_abs_dlogp": float(delta.abs().max()),
            "logp_mismatches": mismatch_count(lp_r, lp_t),
            "velocity_mismatches": vel_mismatch,
            "velocity_elements": vel_total,
            "ratio_spread": float((torch.exp(delta) - 1.0).abs().max()),
        })
    return per_step


def run_consistency(model, *, n_samples: int = 4, steps: int = 3, eta: float = 0.8, seed: int = 0,
                    rollout_batch: int | None = None, replay_micro_batch: int = 1, replay_order: str = "reversed",
                    layout: H3Packing | None = None, mode: str) -> dict:
    """Rollout then replay ``n_samples`` samples through ``steps`` CPS transitions; JSON-able report.

    ``model``: a diffusers ``MiniMaxH3Transformer3DModel`` (e.g. ``flowlock.models.minimax_h3.tiny_h3()``).
    ``rollout_batch`` (default all samples) and ``replay_micro_batch`` set the two batch
    compositions; ``replay_order`` is ``"same"``, ``"reversed"`` or ``"shuffled"`` (seeded).
    Grids: H3 video/audio shifts, ``convention="evaluations"`` (``steps`` transitions). Log-probs:
    verl flavour, joint 0.5/0.5. ``mode="provider"`` runs the stock diffusers forward;
    ``mode="strict"`` runs it under ``flowlock.patch(model, mode="strict")``, removed afterwards.

    Returns per-step ``max_abs_dlogp``, ``logp_mismatches`` (samples whose log-prob bits differ),
    ``velocity_mismatches`` / ``velocity_elements``, ``ratio_spread`` (``max |exp(Δ) - 1|``), and
    per sample the first tensor where replay diverged from rollout (``None`` if none did) and the
    sequence length. ``layout`` is the packed layout every sample shares (default: 24 rows of the
    tiny model). Timing is :func:`flowlock.validate.step_timing.time_rl_step`'s job.
    """
    n_samples = _check_positive_int("n_samples", n_samples)
    steps = _check_positive_int("steps", steps)
    rollout_batch = n_samples if rollout_batch is None else _check_positive_int("rollout_batch", rollout_batch)
    replay_micro_batch = _check_positive_int("replay_micro_batch", replay_micro_batch)
    if replay_order not in REPLAY_ORDERS:
        raise ValueError(f"replay_order must be one of {REPLAY_ORDERS}, got {replay_order!r}")
    if mode not in RUN_MODES:
        raise ValueError(f"mode must be one of {RUN_MODES}, got {mode!r}")
    layout = layout or tiny_packing()
    args = (model, n_samples, steps, eta, seed, rollout_batch, replay_micro_batch, replay_order, layout)
    if mode == "strict":
        handle = flowlock.patch(model, mode="strict")
        try:
            with flowlock.mode("strict"):
                sched, rollout, replay = _run(*args)
        finally:
            handle.remove()
    else:
        with flowlock.mode("provider"):
            sched, rollout, replay = _run(*args)
    per_step = _report(sched, rollout, replay)
    first = []
    for a, b in zip(rollout, replay):
        diff = compare(a, b)
        first.append(None if diff is None else {"sample": a.sample_id, "step": diff.step, "name": diff.name})
    return {
        "mode": mode, "n_samples": n_samples, "steps": steps, "transitions": sched.num_transitions, "eta": eta,
        "seed": seed, "rollout_batch": rollout_batch, "replay_micro_batch": replay_micro_batch,
        "replay_order": replay_order, "convention": sched.convention, "log_prob_flavour": "verl",
        "per_step": per_step,
        "max_abs_dlogp": max(s["max_abs_dlogp"] for s in per_step),
        "ratio_spread": max(s["ratio_spread"] for s in per_step),
        "bitwise_equal": all(s["logp_mismatches"] == 0 and s["velocity_mismatches"] == 0 for s in per_step),
        "first_difference": first,
        "seq_len": layout.seq_len,
    }
