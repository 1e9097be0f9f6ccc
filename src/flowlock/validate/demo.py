"""``flowlock demo``: what an RL step looks like with stock diffusers and with flowlock strict.

One run gathers, for the same model:

- the conditioning-chain replay (:func:`flowlock.validate.chain.chain_replay`);
- the alone-vs-batched traces (:func:`flowlock.validate.batch_trace.run_traces`): where stock's
  bits first change when a sample shares its forward;
- the rollout/replay consistency (:func:`flowlock.validate.consistency.run_consistency`) in each of
  :data:`REPLAY_BATCHINGS`: the rollout runs all samples in one batch, the replay re-reads them the
  way trainers do, in smaller micro-batches and another order;
- the time of one RL step (:func:`flowlock.validate.step_timing.time_rl_step`);
- where stock agreed bitwise in every batching, the committed GPU run of this demo
  (:data:`GPU_RUN`), read from the checkout, so a reader sees the drift this machine did not show.

Packing several requests into one sequence is vLLM-Omni's rollout (``--rollout vllm-omni``): the
stock diffusers H3 has no per-request attention mask, so a diffusers rollout holds one request per
sequence.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

import flowlock
from flowlock.validate.batch_trace import run_traces
from flowlock.validate.chain import chain_replay
from flowlock.validate.consistency import run_consistency
from flowlock.validate.step_timing import time_rl_step

# (replay micro-batch, order) against a rollout of every sample in one batch: one sample per replay
# forward (the smallest GEMMs, where CPU BLAS picks other kernels), and an uneven split in a shuffled
# order (micro-batches of 3: the last one holds the rest).
REPLAY_BATCHINGS = ((1, "reversed"), (3, "shuffled"))
# The committed GPU run of this demo (README, "RL demo"): path in the checkout, and the GPU it ran on.
GPU_RUN = ("benchmarks/results/demo_h200_06f549f.json", "NVIDIA H200")


def load_model(model_dir: str | None, device: torch.device, width: str = "tiny", layers: int = 2):
    """The diffusers H3 from ``model_dir`` (checkpoint dtypes: BF16 with the FP32 modules), else a
    random-weight H3: the embedded tiny one, or H3's full widths with ``layers`` blocks. Returns
    ``(model, description)``."""
    if model_dir is None and width == "tiny":
        from flowlock.models.minimax_h3.tiny import tiny_h3

        return tiny_h3(device=device), "tiny embedded H3 (random weights)"
    if model_dir is None:
        from flowlock.models.minimax_h3.tiny import full_width_config, make_h3

        model = make_h3(full_width_config(num_layers=layers, num_refiner_layers=1), device=device,
                        draw_on_device=device.type == "cuda")
        return model, f"full-width H3, {layers} blocks + 1 refiner block (random weights)"
    from diffusers import MiniMaxH3Transformer3DModel

    model = MiniMaxH3Transformer3DModel.from_pretrained(model_dir, torch_dtype=torch.bfloat16)
    return model.to(device).eval(), f"diffusers checkpoint {model_dir}"


def strict_backends(model) -> list[str]:
    """The ``op:backend`` pairs one strict forward of ``model`` dispatched to."""
    from flowlock.models.minimax_h3.tiny import tiny_inputs

    device = next(model.parameters()).device
    inputs = tiny_inputs(1, seed=0, config=dict(model.config), device=device)
    handle = flowlock.patch(model, mode="strict")
    try:
        with torch.no_grad(), flowlock.mode("strict") as frame:
            model(**inputs)
    finally:
        handle.remove()
    return sorted({f"{op}:{backend}" for op, backend in frame.ran})


def totals(runs: list[dict], mode: str) -> dict:
    """Rollout-vs-replay counts of ``mode`` summed over the batchings of ``runs`` (the demo's
    ``consistency`` list): velocity elements and log-probs that differ, and of how many."""
    steps = [s for run in runs for s in run[mode]["per_step"]]
    return {"velocity_mismatches": sum(s["velocity_mismatches"] for s in steps),
            "velocity_elements": sum(s["velocity_elements"] for s in steps),
            "logp_mismatches": sum(s["logp_mismatches"] for s in steps),
            "log_probs": sum(run[mode]["n_samples"] * run[mode]["transitions"] for run in runs),
            "max_abs_dlogp": max(s["max_abs_dlogp"] for s in steps)}


def gpu_evidence(root: Path) -> dict | None:
    """The counts of :data:`GPU_RUN` under ``root`` (the source checkout), or ``None`` when the file
    is not there (an installed, not checked-out, flowlock)."""
    relative, gpu = GPU_RUN
    path = root / relative
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    # Demo JSONs written before the demo replayed in several batchings hold one {strict, provider} pair.
    runs = data["consistency"] if isinstance(data["consistency"], list) else [data["consistency"]]
    first = runs[0]["strict"]
    return {"file": relative, "gpu": gpu, "model": data["model"], "seq_len": first["seq_len"],
            "n_samples": first["n_samples"], "transitions": first["transitions"],
            "rollout_batch": first["rollout_batch"],
            "batchings": [(run["strict"]["replay_micro_batch"], run["strict"]["replay_order"]) for run in runs],
            "strict": totals(runs, "strict"), "provider": totals(runs, "provider")}


def run_demo(model, description: str, *, samples: int, steps: int, layout=None, rounds: int = 5,
             evidence_root: Path | None = None) -> dict:
    """The whole demo on ``model`` (``description`` says which, e.g. :func:`load_model`'s); a JSON-able
    payload (module docstring). ``evidence_root``: the source checkout holding :data:`GPU_RUN`. ``ok``: the strict path
    is exactly on-policy here (chain repeatable and batch-invariant, strict trace without a
    divergence, every replayed velocity and log-prob bitwise the rollout's); stock's results never
    decide it. Raises ``NotImplementedError`` when a strict piece is missing for ``model``."""
    for name, value in (("samples", samples), ("steps", steps), ("rounds", rounds)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    device = next(model.parameters()).device
    chain = chain_replay(model)
    traces = run_traces(model)
    runs = []
    for micro_batch, order in REPLAY_BATCHINGS:
        runs.append({"replay_micro_batch": micro_batch, "replay_order": order, **{
            mode: run_consistency(model, n_samples=samples, steps=steps, layout=layout, replay_micro_batch=micro_batch,
                                  replay_order=order, mode=mode) for mode in ("strict", "provider")}})
    timing = time_rl_step(model, n_samples=samples, replay_micro_batch=REPLAY_BATCHINGS[0][0], layout=layout,
                          rounds=rounds)
    strict_clean = all(run["strict"]["bitwise_equal"] for run in runs)
    stock_clean = all(run["provider"]["bitwise_equal"] for run in runs)
    ok = chain["ok"] and traces["strict"]["divergence"] is None and strict_clean
    return {"device": str(device), "model": description,
            "backends": sorted(set(chain["backends"]) | set(strict_backends(model))),
            "chain": chain, "trace": traces, "consistency": runs, "timing": timing,
            "gpu_evidence": gpu_evidence(evidence_root) if stock_clean and evidence_root is not None else None,
            "ok": ok}
