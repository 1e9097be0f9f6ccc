"""Issue 2 GPU evidence: H3's conditioning ops, flowlock vs diffusers, forward and backward.

At H3 dims (hidden 5376, E 2688, time MLP 256 → 5376 → 2688, 18H AdaLN table) for S in {4097,
32768, 131072} and T in {1, 3}, each op is timed against the diffusers code it replaces, in the
same process (``harness.time_pair``): forward under ``no_grad``, and backward alone (the forward
graph is built in the untimed setup). On the same inputs the script also checks, per op,

* repeatability: three backward runs, bitwise; for each side the leaves whose gradient varied;
* gradient accuracy at the smallest S: ``max|g - g64| / max|g64|`` per leaf, against an FP64
  evaluation of the op's formula (no intermediate rounding) with the same cotangent.

Run: ``python benchmarks/bench_conditioning.py --out benchmarks/results/conditioning.json``
(``--smoke`` checks the script on CPU at tiny sizes; ``--skip-gate`` on a device whose commit
passed the CPU gate). A PNG next to the JSON is drawn by ``plot.py``.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass

import harness
import torch
import torch.nn.functional as F

GATE_TESTS = ("test_timestep", "test_adaln", "test_final_adaln", "test_rms_norm", "test_gate_residual",
              "test_euler", "test_segment_sum")
FULL = dict(hidden=5376, embed=2688, time_hidden=5376, freq=256, seq=(4097, 32768, 131072), timesteps=(1, 3))
SMOKE = dict(hidden=40, embed=24, time_hidden=48, freq=256, seq=(33,), timesteps=(1, 3))
EPS = 1e-5
LATENT_CHANNELS = 96  # H3 video rows: 24 latent channels x (1, 2, 2) patch


@dataclass
class Case:
    """One op on one shape. ``make`` returns fresh leaves for (flowlock, diffusers); ``ours`` and
    ``theirs`` map leaves to output tensors; ``golden`` is the FP64 formula on float64 leaves."""

    op: str
    seq: int | None
    timesteps: int
    make: Callable[[], tuple[dict, dict]]
    ours: Callable[[dict], tuple[torch.Tensor, ...]]
    theirs: Callable[[dict], tuple[torch.Tensor, ...]]
    golden: Callable[[dict], tuple[torch.Tensor, ...]]
    theirs_setup: Callable[[], None] = lambda: None


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def _table_rows(timesteps: int, seq: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """H3-like rows: 5% text, 15% audio (timestep 1 when T > 1), the rest video."""
    tags = torch.zeros(seq, dtype=torch.long)
    n_text, n_audio = max(1, seq // 20), max(1, (3 * seq) // 20)
    tags[:n_text] = 1
    tags[seq - n_audio:] = 2
    ti = ((tags == 2).long() * min(1, timesteps - 1)).to(device)
    tags = tags.to(device)
    return ti, tags, ti * 3 + tags


def _sinusoid64(t: torch.Tensor, half: int) -> torch.Tensor:
    """diffusers ``get_timestep_embedding`` (cos first, no shift) in float64."""
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float64, device=t.device) / half)
    angles = t[:, None] * freqs
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)


def cases(dims: dict, device: torch.device) -> list[Case]:
    """Every (op, S, T) case of the run, built lazily (``make`` allocates when called)."""
    from diffusers.models.embeddings import TimestepEmbedding, Timesteps
    from diffusers.models.transformers.transformer_minimax_h3 import (
        MiniMaxH3AdaLayerNormModulation,
        MiniMaxH3AdaLayerNormOut,
    )
    from diffusers.schedulers.scheduling_minimax_h3 import MiniMaxH3Scheduler

    from flowlock.ops.adaln import adaln_modulation
    from flowlock.ops.euler import euler_step
    from flowlock.ops.final_adaln import final_adaln_out
    from flowlock.ops.gate_residual import gate_residual
    from flowlock.ops.rms_norm import rms_norm_modulate
    from flowlock.ops.timestep import timestep_mlp, timestep_sinusoid

    h, e, eh, fq = dims["hidden"], dims["embed"], dims["time_hidden"], dims["freq"]
    gen = torch.Generator(device).manual_seed(0)
    rnd = lambda *shape, scale=1.0: torch.randn(*shape, generator=gen, device=device) * scale
    bf16 = torch.bfloat16
    sinusoid_mod = Timesteps(fq, flip_sin_to_cos=True, downscale_freq_shift=0)
    mlp_mod = TimestepEmbedding(fq, eh, out_dim=e).to(device)
    adaln_mod = MiniMaxH3AdaLayerNormModulation(e, h).to(device, bf16)
    norm_mod = torch.nn.RMSNorm(h, eps=EPS).to(device, bf16)
    out_mod = MiniMaxH3AdaLayerNormOut(h, e, EPS).to(device, bf16)
    with torch.no_grad():
        for p in (*adaln_mod.parameters(), *out_mod.linear.parameters()):
            p.copy_(rnd(*p.shape, scale=0.05))
        norm_mod.weight.copy_(1 + rnd(h, scale=0.1))
        out_mod.norm.weight.copy_(1 + rnd(h, scale=0.1))
    sched = MiniMaxH3Scheduler(shift=12.0)
    sched.set_timesteps(10)
    step = 3
    half = fq // 2
    out: list[Case] = []

    for nt in dims["timesteps"]:
        t = torch.linspace(0.2, 0.7, nt).to(device)
        temb = rnd(nt, e)
        out.append(Case(
            "timestep_sinusoid", None, nt,
            make=lambda t=t: ({"t": _leaf(t)}, {"t": _leaf(t)}),
            ours=lambda v: (timestep_sinusoid(v["t"]),),
            theirs=lambda v: (sinusoid_mod(v["t"]),),
            golden=lambda v: (_sinusoid64(v["t"], half),),
        ))
        x_mlp = rnd(nt, fq)
        mlp_leaves = lambda x_mlp=x_mlp: {"x": _leaf(x_mlp), **{n.replace(".", "_"): _leaf(p)
                                                               for n, p in mlp_mod.named_parameters()}}
        out.append(Case(
            "timestep_mlp", None, nt,
            make=lambda f=mlp_leaves: (f(), f()),
            ours=lambda v: (timestep_mlp(v["x"], v["linear_1_weight"], v["linear_1_bias"], v["linear_2_weight"],
                                         v["linear_2_bias"]),),
            theirs=lambda v: (F.linear(F.silu(F.linear(v["x"], v["linear_1_weight"], v["linear_1_bias"])),
                                       v["linear_2_weight"], v["linear_2_bias"]),),
            golden=lambda v: (F.linear(F.silu(F.linear(v["x"], v["linear_1_weight"], v["linear_1_bias"])),
                                       v["linear_2_weight"], v["linear_2_bias"]),),
        ))
        for s in dims["seq"]:
            ti, tags, idx = _table_rows(nt, s, device)
            table = rnd(3 * nt, 6 * h, scale=0.1).to(bf16)
            x, y = rnd(1, s, h).to(bf16), rnd(1, s, h).to(bf16)

            def adaln_leaves(temb=temb):
                return {"temb": _leaf(temb), "weight": _leaf(adaln_mod.linear.weight),
                        "bias": _leaf(adaln_mod.linear.bias)}

            def adaln_theirs(v, idx=idx):
                act = F.silu(v["temb"]).to(v["weight"].dtype)
                chunks = F.linear(act, v["weight"], v["bias"]).view(-1, 6 * h).chunk(6, dim=-1)
                return tuple(c.index_select(0, idx) for c in chunks)

            out.append(Case(
                "adaln_modulation", s, nt, make=lambda f=adaln_leaves: (f(), f()),
                ours=lambda v, ti=ti, tags=tags: tuple(adaln_modulation(v["temb"], v["weight"], v["bias"], ti, tags)),
                theirs=adaln_theirs, golden=adaln_theirs,
            ))

            def mod_leaves(x=x, table=table):
                ours = {"x": _leaf(x), "weight": _leaf(norm_mod.weight), "table": _leaf(table.float())}
                return ours, {"x": _leaf(x), "weight": _leaf(norm_mod.weight), "table": _leaf(table)}

            def mod_theirs(v, idx=idx):
                norm = F.rms_norm(v["x"], (h,), v["weight"], EPS)
                shift, scale = v["table"][:, :h], v["table"][:, h:2 * h]
                return (norm * (1.0 + scale.index_select(0, idx)) + shift.index_select(0, idx),)

            out.append(Case(
                "rms_norm_modulate", s, nt, make=mod_leaves,
                ours=lambda v, idx=idx: (rms_norm_modulate(v["x"], v["weight"], v["table"][:, :h],
                                                           v["table"][:, h:2 * h], idx, EPS),),
                theirs=mod_theirs, golden=mod_theirs,
            ))

            def gate_leaves(x=x, y=y, table=table):
                return ({"residual": _leaf(x), "y": _leaf(y), "table": _leaf(table.float())},
                        {"residual": _leaf(x), "y": _leaf(y), "table": _leaf(table)})

            def gate_theirs(v, idx=idx):
                return (v["residual"] + v["table"][:, 2 * h:3 * h].index_select(0, idx) * v["y"],)

            out.append(Case(
                "gate_residual", s, nt, make=gate_leaves,
                ours=lambda v, idx=idx: (gate_residual(v["residual"], v["table"][:, 2 * h:3 * h], v["y"], idx),),
                theirs=gate_theirs, golden=gate_theirs,
            ))

            def out_leaves(x=x, temb=temb):
                return {"x": _leaf(x), "temb": _leaf(temb), "norm_weight": _leaf(out_mod.norm.weight),
                        "weight": _leaf(out_mod.linear.weight), "bias": _leaf(out_mod.linear.bias)}

            def out_theirs(v, ti=ti):
                act = F.silu(v["temb"]).to(v["weight"].dtype)
                shift, scale = F.linear(act, v["weight"], v["bias"]).chunk(2, dim=-1)
                norm = F.rms_norm(v["x"], (h,), v["norm_weight"], EPS)
                return (norm * (1.0 + scale.index_select(0, ti)) + shift.index_select(0, ti),)

            out.append(Case(
                "final_adaln_out", s, nt, make=lambda f=out_leaves: (f(), f()),
                ours=lambda v, ti=ti: (final_adaln_out(v["x"], v["temb"], v["norm_weight"], v["weight"], v["bias"],
                                                       ti, EPS),),
                theirs=out_theirs, golden=out_theirs,
            ))

    timestep = sched.timesteps[step]
    sigma, sigma_next = sched.sigmas[step], sched.sigmas[step + 1]
    # A sampler holds its schedule on the device: copy once, not inside the timed call.
    sched_dev = tuple(v.to(device) for v in (timestep, sigma, sigma_next))
    for s in dims["seq"]:
        sample, velocity = rnd(1, s, LATENT_CHANNELS), rnd(1, s, LATENT_CHANNELS)

        def euler_leaves(sample=sample, velocity=velocity):
            return {"sample": _leaf(sample), "velocity": _leaf(velocity)}

        def euler_theirs(v):
            return (sched.step(v["velocity"], timestep, v["sample"]).prev_sample,)

        def euler_golden(v):
            x0 = v["sample"] + (1 - timestep.double()) * v["velocity"]
            r = float(sigma_next) / float(sigma)
            return (r * v["sample"] + (1 - r) * x0,)

        def reset_step():
            sched._step_index = step

        out.append(Case(
            "euler_step", s, 1, make=lambda f=euler_leaves: (f(), f()),
            ours=lambda v, sched_dev=sched_dev: (euler_step(v["sample"], v["velocity"], *sched_dev),),
            theirs=lambda v, reset=reset_step: (reset(), euler_theirs(v))[1],
            golden=euler_golden, theirs_setup=reset_step,
        ))
    return out


def _cotangents(outs: tuple[torch.Tensor, ...], seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(o.shape, generator=gen).to(o.device, o.dtype) for o in outs)


def _grads(fn, leaves: dict, cots) -> dict[str, torch.Tensor]:
    outs = fn(leaves)
    names = list(leaves)
    grads = torch.autograd.grad(outs, [leaves[n] for n in names], [c.to(o.dtype) for c, o in zip(cots, outs)],
                                allow_unused=True)
    return {n: g for n, g in zip(names, grads) if g is not None}


def _repeat_varying(fn, make_leaves, cots, runs: int = 3) -> list[str]:
    """Leaves whose gradient is not bitwise equal across ``runs`` fresh forward+backward runs."""
    from flowlock.testing import bitwise_equal

    results = [_grads(fn, make_leaves(), cots) for _ in range(runs)]
    return sorted(n for n in results[0] if not all(bitwise_equal(r[n], results[0][n]) for r in results[1:]))


def _accuracy(case: Case, cots) -> dict:
    """Per leaf ``max|g - g64| / max|g64|`` for flowlock and diffusers against the FP64 formula."""
    ours_leaves, theirs_leaves = case.make()
    golden_leaves = {n: _leaf(v.detach().double()) for n, v in theirs_leaves.items()}
    g64 = _grads(case.golden, golden_leaves, tuple(c.double() for c in cots))
    case.theirs_setup()
    g_ours, g_theirs = _grads(case.ours, ours_leaves, cots), _grads(case.theirs, theirs_leaves, cots)
    rel = lambda g, ref: float((g.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-300))
    return {n: {"flowlock": rel(g_ours[n], g64[n]), "diffusers": rel(g_theirs[n], g64[n])} for n in g64}


def run_case(case: Case, args, device: torch.device, with_accuracy: bool) -> dict:
    ours_leaves, theirs_leaves = case.make()
    with torch.no_grad():
        case.theirs_setup()
        cots = _cotangents(case.theirs(theirs_leaves), seed=1)

    def backward_setup(fn, leaves):
        def setup():
            case.theirs_setup()
            outs = fn(leaves)
            return outs, [leaves[n] for n in leaves], [c.to(o.dtype) for c, o in zip(cots, outs)]
        return setup

    bwd_fn = lambda st: torch.autograd.grad(st[0], st[1], st[2], allow_unused=True)
    row = {"op": case.op, "S": case.seq, "T": case.timesteps}
    for suffix, queued in (("", False), ("_queued", True)):
        with torch.no_grad():
            fwd = harness.time_pair(case.ours, case.theirs, device=device, setup_a=lambda: ours_leaves,
                                    setup_b=lambda: (case.theirs_setup(), theirs_leaves)[1], iters=args.iters,
                                    warmup=args.warmup, queued=queued)
        with torch.enable_grad():
            bwd = harness.time_pair(bwd_fn, bwd_fn, device=device, setup_a=backward_setup(case.ours, ours_leaves),
                                    setup_b=backward_setup(case.theirs, theirs_leaves), iters=args.iters,
                                    warmup=args.warmup, queued=queued)
        row["forward" + suffix] = {"flowlock": fwd["a"], "diffusers": fwd["b"], "speedup": 1 / fwd["ratio_a_over_b"]}
        row["backward" + suffix] = {"flowlock": bwd["a"], "diffusers": bwd["b"],
                                    "speedup": 1 / bwd["ratio_a_over_b"]}
    with torch.enable_grad():
        row["grads_varying_over_3_runs"] = {
            "flowlock": _repeat_varying(case.ours, lambda: case.make()[0], cots),
            "diffusers": _repeat_varying(lambda v: (case.theirs_setup(), case.theirs(v))[1],
                                         lambda: case.make()[1], cots),
        }
        if with_accuracy:
            row["grad_rel_error_vs_fp64"] = _accuracy(case, cots)
    return row


def _extra(parser) -> None:
    parser.add_argument("--seqs", type=int, nargs="*", default=None, help=f"sequence lengths (default {FULL['seq']})")


def main(argv=None) -> int:
    args = harness.parse_args(__doc__.splitlines()[0], argv, _extra)
    device = torch.device(args.device)
    tests = sorted(str(p.relative_to(harness.REPO)) for name in GATE_TESTS
                   for p in (harness.REPO / "tests" / "ops").glob(f"{name}*.py"))
    if not tests and not args.skip_gate:
        print("no conditioning-op tests found for the gate; refusing to benchmark", file=sys.stderr)
        return 2
    gate = harness.gate_or_exit(args, tests)
    dims = SMOKE if args.smoke else dict(FULL, seq=tuple(args.seqs or FULL["seq"]))
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    for case in cases(dims, device):
        with_accuracy = case.seq in (None, min(dims["seq"]))
        rows.append(run_case(case, args, device, with_accuracy))
        r = rows[-1]
        print(f"{case.op:18s} S={case.seq} T={case.timesteps}: fwd x{r['forward']['speedup']:.2f} "
              f"bwd x{r['backward']['speedup']:.2f} (idle); fwd x{r['forward_queued']['speedup']:.2f} "
              f"bwd x{r['backward_queued']['speedup']:.2f} (queued) (diffusers/flowlock)", flush=True)
    payload = {"benchmark": "conditioning", "smoke": args.smoke, "dims": dims, "gate": gate,
               "environment": harness.environment(device),
               "method": "same process, alternating order, median/p20/p80 of >= 20 timed calls after warm-up; "
                         "backward timed alone (forward graph built untimed); speedup = diffusers/flowlock. "
                         "forward/backward: each call from an idle GPU (host time before and between launches "
                         "counts); *_queued: each call enqueued behind a ~5 ms GPU spin, as inside a model "
                         "forward where the host runs ahead (the call's kernels back to back)",
               "golden": "float64 evaluation of each op's formula, no intermediate rounding, same cotangent",
               "results": rows}
    path = harness.write_json(args.out, payload)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
