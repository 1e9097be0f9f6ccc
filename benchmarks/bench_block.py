"""Issue 3 block-stack evidence: the strict H3 path vs the provider at full width.

A random-weight diffusers ``MiniMaxH3Transformer3DModel`` at H3's full widths with 2 blocks and 1
refiner block (BF16, FP32 modules kept FP32), for packed sequences of S in {4096, 16384} rows
(about 5% text, 15% audio, the rest video). The same model instance runs strict
(``flowlock.patch(model, mode="strict")``) and provider (the same patched
model inside ``flowlock.mode("provider")``, which calls the stock forward). Reported per S:

* forward (``no_grad``) and forward+backward times, same process, alternating order;
* a per-op breakdown: ``torch.profiler`` over one forward+backward of each, device time grouped by
  kernel-name prefix;
* peak memory of one forward+backward of each;
* at the smaller S: bitwise repeatability (3 forward+backward runs: outputs and every parameter
  gradient) and batch invariance (sample 0 alone vs inside a batch of 2) for strict and provider.

Run: ``python benchmarks/bench_block.py --out benchmarks/results/block.json`` (``--smoke`` runs
the tiny H3 on CPU to check the script).
"""

from __future__ import annotations

import sys

import harness
import torch

import flowlock

GATE_TESTS = ("tests/models",)
FULL_SEQ = (4096, 16384)
SMOKE_SEQ = (40, 64)


def _outputs(model, inputs: dict, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    with flowlock.mode(mode):
        out = model(**inputs, return_dict=False)
    return out[0], out[1]


def _fwd_bwd(model, inputs: dict, cots, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    video, audio = _outputs(model, inputs, mode)
    loss = (video.float() * cots[0]).sum() + (audio.float() * cots[1]).sum()
    loss.backward()
    return video, audio


def cotangents_for(model, inputs: dict, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed random cotangents shaped like the two outputs (FP32)."""
    with torch.no_grad():
        video, audio = _outputs(model, inputs, "provider")
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(video.shape, generator=gen).to(video.device),
            torch.randn(audio.shape, generator=gen).to(audio.device))


def breakdown(model, inputs: dict, cots, mode: str, device: torch.device, top: int = 25) -> list[dict]:
    """Device time (ms) of one forward+backward, grouped by kernel-name prefix, largest first."""
    model.zero_grad(set_to_none=True)
    return harness.kernel_times(lambda: _fwd_bwd(model, inputs, cots, mode), device, top)


def peak_memory(model, inputs: dict, cots, mode: str, device: torch.device) -> int | None:
    """Peak allocated bytes over one forward+backward (``None`` off CUDA)."""
    if device.type != "cuda":
        return None
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    _fwd_bwd(model, inputs, cots, mode)
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated(device))


def checks(model, inputs2: dict, cots2, mode: str, runs: int = 3) -> dict:
    """Bitwise repeatability of outputs and parameter gradients, and sample-0 batch invariance
    (alone vs a batch of 2)."""
    from flowlock.testing import bitwise_equal, mismatch_count

    named = dict(model.named_parameters())
    results = []
    for _ in range(runs):
        model.zero_grad(set_to_none=True)
        video, audio = _fwd_bwd(model, inputs2, cots2, mode)
        grads = {n: p.grad.detach().clone() for n, p in named.items() if p.grad is not None}
        results.append(((video.detach().clone(), audio.detach().clone()), grads))
    model.zero_grad(set_to_none=True)
    (out0, grads0) = results[0]
    varying = sorted(n for n in grads0 if not all(bitwise_equal(r[1][n], grads0[n]) for r in results[1:]))
    outputs_repeat = all(bitwise_equal(a, b) for r in results[1:] for a, b in zip(r[0], out0))

    batched = {"hidden_states", "audio_hidden_states", "encoder_hidden_states"}
    alone = {k: (v[:1] if k in batched else v) for k, v in inputs2.items()}
    with torch.no_grad():
        a_video, a_audio = _outputs(model, alone, mode)
        b_video, b_audio = _outputs(model, inputs2, mode)
    mism = mismatch_count(a_video[0], b_video[0]) + mismatch_count(a_audio[0], b_audio[0])
    total = a_video[0].numel() + a_audio[0].numel()
    return {"outputs_repeatable": outputs_repeat, "param_grads": len(grads0), "param_grads_varying": len(varying),
            "varying": varying, "batch_invariant": mism == 0, "alone_vs_batched_mismatches": mism,
            "alone_vs_batched_elements": total}


def _extra(parser) -> None:
    parser.add_argument("--seqs", type=int, nargs="*", default=None, help=f"sequence lengths (default {FULL_SEQ})")


def main(argv=None) -> int:
    from flowlock.models.minimax_h3.packing import packing_for_length
    from flowlock.models.minimax_h3.tiny import TINY_H3_CONFIG, full_width_config, make_h3, tiny_inputs

    args = harness.parse_args(__doc__.splitlines()[0], argv, _extra)
    device = torch.device(args.device)
    gate = harness.gate_or_exit(args, list(GATE_TESTS))
    torch.backends.cuda.matmul.allow_tf32 = False
    config = dict(TINY_H3_CONFIG) if args.smoke else full_width_config(num_layers=2, num_refiner_layers=1)
    seqs = SMOKE_SEQ if args.smoke else tuple(args.seqs or FULL_SEQ)
    model = make_h3(config, seed=0, dtype=torch.bfloat16, device=device, draw_on_device=not args.smoke)
    handle = flowlock.patch(model, mode="strict")
    rows = []
    try:
        for s in seqs:
            layout = packing_for_length(s)
            inputs = tiny_inputs(1, seed=s, config=config, packing=layout, device=device)
            cots = cotangents_for(model, inputs)

            def run_fwd(mode, inputs=inputs):
                with torch.no_grad():
                    _outputs(model, inputs, mode)

            def run_fwd_bwd(mode, inputs=inputs, cots=cots):
                _fwd_bwd(model, inputs, cots, mode)

            zero = lambda: model.zero_grad(set_to_none=True)
            fwd = harness.time_pair(lambda _: run_fwd("strict"), lambda _: run_fwd("provider"), device=device,
                                    iters=args.iters, warmup=args.warmup)
            both = harness.time_pair(lambda _: run_fwd_bwd("strict"), lambda _: run_fwd_bwd("provider"),
                                     device=device, setup_a=zero, setup_b=zero, iters=args.iters,
                                     warmup=args.warmup)
            row = {
                "S": s, "video_rows": layout.video_indices.numel(), "audio_rows": layout.audio_indices.numel(),
                "text_rows": layout.text_indices.numel(),
                "forward": {"strict": fwd["a"], "provider": fwd["b"], "strict_over_provider": fwd["ratio_a_over_b"]},
                "forward_backward": {"strict": both["a"], "provider": both["b"],
                                     "strict_over_provider": both["ratio_a_over_b"]},
                "peak_memory_bytes": {m: peak_memory(model, inputs, cots, m, device) for m in ("strict", "provider")},
                "breakdown_ms": {m: breakdown(model, inputs, cots, m, device) for m in ("strict", "provider")},
            }
            if s == min(seqs):
                inputs2 = tiny_inputs(2, seed=s, config=config, packing=layout, device=device)
                cots2 = cotangents_for(model, inputs2)
                row["checks"] = {m: checks(model, inputs2, cots2, m) for m in ("strict", "provider")}
            rows.append(row)
            print(f"S={s}: forward strict/provider {fwd['ratio_a_over_b']:.3f}, forward+backward "
                  f"{both['ratio_a_over_b']:.3f}", flush=True)
    finally:
        handle.remove()
    payload = {"benchmark": "block", "smoke": args.smoke, "config": config, "gate": gate,
               "environment": harness.environment(device),
               "method": "same model instance, strict vs provider mode, same process, alternating order, "
                         "median/p20/p80 of >= 20 timed calls after warm-up; zero_grad untimed",
               "results": rows}
    path = harness.write_json(args.out, payload)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
