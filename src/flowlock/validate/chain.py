"""Conditioning-chain replay: H3's timestep → AdaLN → modulation chain, flowlock vs the provider.

The chain runs six stages on the real modules of a diffusers ``MiniMaxH3Transformer3DModel``
(``time_proj``, ``time_embedder``, block 0's ``adaln_proj`` and ``norm1``, ``norm_out``):

1. ``timestep_sinusoid``  t (T,) → (T, 256) fp32
2. ``timestep_mlp``       → temb (T, E) fp32
3. ``adaln_modulation``   → six (S, H) bf16 rows (table row ``ti*3 + tag`` per sequence row)
4. ``norm1_modulate``     x (B, S, H) → ``norm1(x) * (1 + scale) + shift``
5. ``gate_residual``      → ``x + gate_msa * stage4`` (stage 4 stands in for the attention output)
6. ``norm_out``           → the final AdaLN norm, modulated per row by ``timestep_indices``

Path ``flowlock`` calls flowlock's public ops; path ``provider`` calls the diffusers modules the
way the diffusers block does. Each path feeds its own outputs forward (``chained``). Per stage the
report says whether it is bitwise repeatable, whether one sample's output is the same bits alone
and inside a batch (the batch adds two samples around it and two extra timesteps after the real
ones), and for flowlock whether it equals the provider chained and given the provider's own inputs
(``local``); ``first_drifting_stage`` is the first stage where the chained outputs part. The
backward of a fixed scalar loss gives parameter gradients (checked for repeatability) and the
input gradient of ``x`` (checked for batch invariance too).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import torch

import flowlock
from flowlock.testing import bitwise_equal, mismatch_count

STAGES = ("timestep_sinusoid", "timestep_mlp", "adaln_modulation", "norm1_modulate", "gate_residual",
          "norm_out")

Stage = tuple[torch.Tensor, ...]


def _params(model) -> dict[str, torch.nn.Parameter]:
    """The parameters the chain differentiates, by their model-qualified names."""
    block = model.transformer_blocks[0]
    te = model.time_embedder
    return {
        "time_embedder.linear_1.weight": te.linear_1.weight,
        "time_embedder.linear_1.bias": te.linear_1.bias,
        "time_embedder.linear_2.weight": te.linear_2.weight,
        "time_embedder.linear_2.bias": te.linear_2.bias,
        "transformer_blocks.0.adaln_proj.linear.weight": block.adaln_proj.linear.weight,
        "transformer_blocks.0.adaln_proj.linear.bias": block.adaln_proj.linear.bias,
        "transformer_blocks.0.norm1.weight": block.norm1.weight,
        "norm_out.norm.weight": model.norm_out.norm.weight,
        "norm_out.linear.weight": model.norm_out.linear.weight,
        "norm_out.linear.bias": model.norm_out.linear.bias,
    }


def flowlock_stages(model, t: torch.Tensor, x: torch.Tensor, timestep_indices: torch.Tensor,
                    token_tags: torch.Tensor, feed: dict[str, Stage] | None = None) -> dict[str, Stage]:
    """The chain through flowlock's public ops. ``feed`` (stage name → outputs) replaces that stage's
    outputs wherever a later stage reads them: fed every provider output, each stage runs on exactly
    the provider's inputs."""
    from flowlock.ops.adaln import adaln_modulation
    from flowlock.ops.final_adaln import final_adaln_out
    from flowlock.ops.gate_residual import gate_residual
    from flowlock.ops.rms_norm import rms_norm_modulate
    from flowlock.ops.timestep import timestep_mlp, timestep_sinusoid

    feed = feed or {}
    block = model.transformer_blocks[0]
    te = model.time_embedder
    rows = torch.arange(timestep_indices.shape[0], device=x.device)
    out: dict[str, Stage] = {}

    def inp(stage: str) -> Stage:
        return feed.get(stage, out.get(stage))

    out["timestep_sinusoid"] = (timestep_sinusoid(t),)
    out["timestep_mlp"] = (timestep_mlp(inp("timestep_sinusoid")[0], te.linear_1.weight, te.linear_1.bias,
                                        te.linear_2.weight, te.linear_2.bias),)
    temb = inp("timestep_mlp")[0]
    out["adaln_modulation"] = tuple(adaln_modulation(temb, block.adaln_proj.linear.weight,
                                                     block.adaln_proj.linear.bias, timestep_indices, token_tags))
    shift, scale, gate = inp("adaln_modulation")[:3]
    out["norm1_modulate"] = (rms_norm_modulate(x, block.norm1.weight, shift, scale, rows, block.norm1.eps),)
    out["gate_residual"] = (gate_residual(x, gate, inp("norm1_modulate")[0], rows),)
    out["norm_out"] = (final_adaln_out(inp("gate_residual")[0], temb, model.norm_out.norm.weight,
                                       model.norm_out.linear.weight, model.norm_out.linear.bias,
                                       timestep_indices, model.norm_out.norm.eps),)
    return out


def provider_stages(model, t: torch.Tensor, x: torch.Tensor, timestep_indices: torch.Tensor,
                    token_tags: torch.Tensor) -> dict[str, Stage]:
    """The same chain through the diffusers modules, written as ``MiniMaxH3TransformerBlock`` does."""
    block = model.transformer_blocks[0]
    adaln_indices = timestep_indices * 3 + token_tags
    out: dict[str, Stage] = {}
    out["timestep_sinusoid"] = (model.time_proj(t),)
    temb = model.time_embedder(out["timestep_sinusoid"][0].to(model.time_embedder.linear_1.weight.dtype))
    out["timestep_mlp"] = (temb,)
    out["adaln_modulation"] = tuple(c.index_select(0, adaln_indices) for c in block.adaln_proj(temb))
    shift, scale, gate = out["adaln_modulation"][:3]
    out["norm1_modulate"] = (block.norm1(x) * (1.0 + scale) + shift,)
    out["gate_residual"] = (x + gate * out["norm1_modulate"][0],)
    out["norm_out"] = (model.norm_out(out["gate_residual"][0], temb, timestep_indices),)
    return out


def _chain_inputs(model, batch: int, position: int, seed: int, layout, timestep: tuple[float, ...]) -> dict:
    """Alone and batched inputs: the batched run holds the sample at ``position`` among ``batch``
    and two extra timesteps after the real ones (the layout only indexes the real ones)."""
    device = next(model.parameters()).device
    hidden = model.config.hidden_size
    s = layout.seq_len
    gen = torch.Generator().manual_seed(seed)
    x_all = torch.randn(batch, s, hidden, generator=gen).to(torch.bfloat16)
    cot_all = torch.randn(batch, s, hidden, generator=gen)
    t = torch.tensor(timestep, dtype=torch.float32)
    t_extra = torch.tensor([0.9, 0.05], dtype=torch.float32)
    order = [position] + [i for i in range(batch) if i != position]
    x_batched = torch.empty_like(x_all)
    cot_batched = torch.empty_like(cot_all)
    x_batched[position], cot_batched[position] = x_all[0], cot_all[0]
    for dst, src in zip(order[1:], range(1, batch)):
        x_batched[dst], cot_batched[dst] = x_all[src], cot_all[src]
    common = dict(timestep_indices=layout.timestep_indices.to(device), token_tags=layout.token_tags.to(device))
    return {
        "alone": dict(t=t.to(device), x=x_all[:1].to(device), cot=cot_all[:1].to(device), **common),
        "batched": dict(t=torch.cat([t, t_extra]).to(device), x=x_batched.to(device), cot=cot_batched.to(device),
                        **common),
        "num_timesteps": t.numel(),
    }


def _run(stages_fn: Callable[..., dict[str, Stage]], model, inputs: dict, backward: bool) -> dict:
    """One forward (and backward of ``sum(norm_out * cot)``) of a path; detached copies."""
    params = _params(model)
    x = inputs["x"].detach().clone().requires_grad_(backward)
    with torch.enable_grad() if backward else torch.no_grad():
        stages = stages_fn(model, inputs["t"], x, inputs["timestep_indices"], inputs["token_tags"])
        result = {"stages": {k: tuple(o.detach().clone() for o in v) for k, v in stages.items()}}
        if backward:
            loss = (stages["norm_out"][0].float() * inputs["cot"]).sum()
            names = list(params)
            grads = torch.autograd.grad(loss, [params[n] for n in names] + [x], allow_unused=True)
            result["grads"] = {n: g.detach().clone() for n, g in zip(names, grads[:-1]) if g is not None}
            result["x_grad"] = grads[-1].detach().clone()
    return result


def _stage_alone_vs_batched(stage: str, alone: Stage, batched: Stage, num_timesteps: int, position: int) -> bool:
    if stage in ("timestep_sinusoid", "timestep_mlp"):
        return all(bitwise_equal(b[:num_timesteps], a) for a, b in zip(alone, batched))
    if stage == "adaln_modulation":
        return all(bitwise_equal(b, a) for a, b in zip(alone, batched))
    return all(bitwise_equal(b[position], a[0]) for a, b in zip(alone, batched))


def _all_equal(a: Stage, b: Stage) -> bool:
    return len(a) == len(b) and all(bitwise_equal(x, y) for x, y in zip(a, b))


def _mismatches(a: Stage, b: Stage) -> int:
    return sum(mismatch_count(x, y) if x.shape == y.shape and x.dtype == y.dtype else x.numel()
               for x, y in zip(a, b))


def _path_report(stages_fn, model, inputs: dict, repeats: int, position: int, backward: bool) -> dict:
    runs = [_run(stages_fn, model, inputs["alone"], backward) for _ in range(repeats)]
    batched = _run(stages_fn, model, inputs["batched"], backward)
    first = runs[0]
    report = {"stages": [], "grads": []}
    for stage in STAGES:
        report["stages"].append({
            "stage": stage,
            "repeat_equal": all(_all_equal(r["stages"][stage], first["stages"][stage]) for r in runs[1:]),
            "invariant": _stage_alone_vs_batched(stage, first["stages"][stage], batched["stages"][stage],
                                                 inputs["num_timesteps"], position),
        })
    if backward:
        for name, g in first["grads"].items():
            report["grads"].append({
                "param": name,
                "repeat_equal": all(bitwise_equal(r["grads"][name], g) for r in runs[1:]),
                "max_mismatches": max((mismatch_count(r["grads"][name], g) for r in runs[1:]), default=0),
                "numel": g.numel(),
            })
        report["x_grad_repeat_equal"] = all(bitwise_equal(r["x_grad"], first["x_grad"]) for r in runs[1:])
        report["x_grad_invariant"] = bitwise_equal(batched["x_grad"][position], first["x_grad"][0])
    report["_outputs"] = first["stages"]
    return report


def chain_replay(model, *, batch: int = 3, position: int = 1, repeats: int = 3, seed: int = 0, layout=None,
                 timestep: tuple[float, ...] = (0.3, 0.55), backward: bool = True,
                 backend: str | None = None) -> dict:
    """Replay the conditioning chain on ``model`` (a diffusers H3, e.g. ``tiny_h3()``) and return a
    JSON-able report:

    ``{"device", "backends", "first_drifting_stage", "flowlock": {...}, "provider": {...}, "ok"}``
    where each path holds ``stages`` (per stage ``repeat_equal``, ``invariant``; flowlock also
    ``chained_vs_provider``, ``local_vs_provider`` and the mismatch counts) and ``grads`` (per
    parameter ``repeat_equal``), ``x_grad_repeat_equal`` and ``x_grad_invariant``. ``ok`` is true
    when every flowlock stage and gradient is repeatable and invariant. ``backend`` forces the
    flowlock ops' backend (``"triton"`` needs a GPU or ``TRITON_INTERPRET=1``).
    """
    from flowlock.models.minimax_h3.tiny import tiny_packing

    if batch < 2 or not 0 <= position < batch:
        raise ValueError(f"need batch >= 2 and 0 <= position < batch, got batch={batch} position={position}")
    if repeats < 2:
        raise ValueError(f"repeats must be >= 2, got {repeats}")
    layout = layout or tiny_packing()
    inputs = _chain_inputs(model, batch, position, seed, layout, timestep)
    forced = flowlock.use_backend(backend) if backend else nullcontext()
    with flowlock.mode("strict") as handle, forced:
        ours = _path_report(flowlock_stages, model, inputs, repeats, position, backward)
    with flowlock.mode("provider"):
        theirs = _path_report(provider_stages, model, inputs, repeats, position, backward)

    alone = inputs["alone"]
    args = (model, alone["t"], alone["x"], alone["timestep_indices"], alone["token_tags"])
    with torch.no_grad(), flowlock.mode("strict"), (flowlock.use_backend(backend) if backend else nullcontext()):
        # Every stage reads its inputs from the provider's outputs: each flowlock stage on the provider's inputs.
        local = flowlock_stages(*args, feed=theirs["_outputs"])
    first_drift = None
    for entry in ours["stages"]:
        stage = entry["stage"]
        mine, provider = ours["_outputs"][stage], theirs["_outputs"][stage]
        entry["chained_vs_provider"] = _all_equal(mine, provider)
        entry["chained_mismatches"] = _mismatches(mine, provider)
        entry["local_vs_provider"] = _all_equal(local[stage], provider)
        entry["local_mismatches"] = _mismatches(local[stage], provider)
        entry["numel"] = sum(o.numel() for o in provider)
        if first_drift is None and not entry["chained_vs_provider"]:
            first_drift = stage
    del ours["_outputs"], theirs["_outputs"]

    ok = all(s["repeat_equal"] and s["invariant"] for s in ours["stages"])
    if backward:
        ok = ok and all(g["repeat_equal"] for g in ours["grads"]) and ours["x_grad_repeat_equal"] \
            and ours["x_grad_invariant"]
    return {
        "device": str(alone["x"].device),
        "backends": sorted({f"{op}:{b}" for op, b in handle.ran}),
        "batch": batch,
        "position": position,
        "repeats": repeats,
        "seq_len": layout.seq_len,
        "hidden": model.config.hidden_size,
        "first_drifting_stage": first_drift,
        "flowlock": ours,
        "provider": theirs,
        "ok": ok,
    }
