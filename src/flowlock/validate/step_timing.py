"""Wall time of one RL step, strict against stock diffusers, measured the way a reader can trust.

One RL step here is the demo's unit of work at one noise level: the rollout forward of all
``n_samples`` in one batch (no autograd) plus the replay forwards of the same samples in
micro-batches of ``replay_micro_batch`` (autograd recording, as a trainer's forward; no backward),
each followed by the video and audio CPS transitions. Both paths first run ``warmup`` untimed
steps (kernel compilation, allocator growth and first-call caches stay out of the figures), then
``rounds`` timed steps each, alternating which path goes first; the report gives every round and
the median per path, and the ratio of the medians (strict / stock: above 1 means strict is slower).
"""

from __future__ import annotations

import statistics
import time

import torch

import flowlock
from flowlock.models.minimax_h3 import H3Packing, tiny_inputs
from flowlock.models.minimax_h3.tiny import tiny_packing
from flowlock.rl.minimax_h3 import h3_schedules
from flowlock.rl.noise import batch_noise
from flowlock.validate.consistency import step_batch

MODES = ("strict", "provider")


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _rl_step(model, inputs: dict, n_samples: int, replay_micro_batch: int, eta: float, seed: int) -> None:
    layout_kwargs, text, xv, xa, timestep, sigmas = (inputs[k] for k in ("layout", "text", "video", "audio",
                                                                         "timestep", "sigmas"))
    rows = list(range(n_samples))
    noises = tuple(batch_noise(seed, rows, 0, modality, tuple(x.shape[1:]), batch=n_samples, device=x.device)
                   for modality, x in (("video", xv), ("audio", xa)))
    with torch.no_grad():
        _, _, next_v, next_a, _ = step_batch(model, layout_kwargs, text, xv, xa, timestep, sigmas, eta, noises=noises)
    for start in range(0, n_samples, replay_micro_batch):
        part = slice(start, start + replay_micro_batch)
        with torch.enable_grad():
            step_batch(model, layout_kwargs, text[part], xv[part], xa[part], timestep, sigmas, eta,
                       targets=(next_v[part], next_a[part]))


def _timed(model, mode: str, step) -> float:
    """One step of ``mode``; strict is patched outside the clock, so the figure is the step alone."""
    device = next(model.parameters()).device
    handle = flowlock.patch(model, mode="strict") if mode == "strict" else None
    try:
        with flowlock.mode(mode):
            start = _clock(device)
            step()
            return _clock(device) - start
    finally:
        if handle is not None:
            handle.remove()


def time_rl_step(model, *, n_samples: int = 4, replay_micro_batch: int = 1, layout: H3Packing | None = None,
                 rounds: int = 5, warmup: int = 1, eta: float = 0.8, seed: int = 0) -> dict:
    """Median wall seconds of one RL step (module docstring) for strict and stock diffusers.

    ``model``: a diffusers ``MiniMaxH3Transformer3DModel``; ``layout`` the packed layout of every
    sample (default: the tiny model's 24 rows). Returns a JSON-able dict: ``seconds`` (per mode,
    every timed round in order), ``median_s`` (per mode), ``ratio`` (strict median / stock median),
    ``order`` (the path run first in each round) and the arguments.
    """
    for name, value, least in (("n_samples", n_samples, 1), ("replay_micro_batch", replay_micro_batch, 1),
                               ("rounds", rounds, 1), ("warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    device = next(model.parameters()).device
    layout = (layout or tiny_packing()).to(device)
    given = tiny_inputs(n_samples, seed=seed, config=dict(model.config), packing=layout, device=device)
    sched = h3_schedules(2, convention="evaluations")
    inputs = {"layout": layout.model_kwargs(), "text": given["encoder_hidden_states"],
              "video": given["hidden_states"], "audio": given["audio_hidden_states"],
              "timestep": torch.stack([sched.video_timesteps[0], sched.audio_timesteps[0]]).to(device),
              "sigmas": ((sched.video_sigmas[0], sched.video_sigmas[1]),
                         (sched.audio_sigmas[0], sched.audio_sigmas[1]))}

    def step():
        _rl_step(model, inputs, n_samples, replay_micro_batch, eta, seed)

    for _ in range(warmup):
        for mode in MODES:
            _timed(model, mode, step)
    seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
    order = []
    for r in range(rounds):
        first = MODES[r % 2]
        order.append(first)
        for mode in (first, *(m for m in MODES if m != first)):
            seconds[mode].append(_timed(model, mode, step))
    median = {mode: statistics.median(values) for mode, values in seconds.items()}
    return {"n_samples": n_samples, "replay_micro_batch": replay_micro_batch, "seq_len": layout.seq_len,
            "rounds": rounds, "warmup": warmup, "order": order, "seconds": seconds, "median_s": median,
            "ratio": median["strict"] / median["provider"]}
