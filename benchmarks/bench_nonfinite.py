"""Issue 38 evidence: the cost of strict mode's non-finite input check at full depth, and of the call-time model check.

Measured on one patched full-width H3 (random weights, gradient checkpointing on, as ``bench_model``):

* ``check``: the non-finite check alone (``flowlock.finite.check_finite_samples`` on the three latents:
  one reduction per tensor and ONE host sync), timed from an idle device;
* ``model_check``: host time of the call-time dtype / device check of the model when nothing changed
  (``guards.check_model``; no device work), ``perf_counter``;
* ``forward`` / ``step`` (forward + backward of a fixed cotangent loss, gradients set to None untimed):
  the strict call with the check on against the same call inside ``flowlock.nonfinite_check(False)``,
  same process, order alternating, CUDA events, median of ``--iters`` (>= 20) after warm-up
  (``harness.time_pair``); ``ratio_on_over_off`` is the check's share of a call.

Usage: ``python benchmarks/bench_nonfinite.py --out benchmarks/results/nonfinite_h200.json``
(``--seq 4253 --layers 50 --batch 1 --measures forward,step`` by default); ``--smoke`` runs the tiny H3 on CPU.
"""

from __future__ import annotations

import argparse
import time

import bench_block
import harness
import torch
from bench_model import REFINER_LAYERS, TEXT_ROWS, build_model, model_packing

import flowlock
from flowlock.finite import check_finite_samples
from flowlock.models.minimax_h3.guards import check_model

LATENTS = ("hidden_states", "audio_hidden_states", "encoder_hidden_states")
GATE_TESTS = ("tests/models/test_h3_guards.py",)
MEASURES = ("forward", "step")


def _extra(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seq", type=int, default=4253, help="packed sequence length S (default 4253)")
    parser.add_argument("--layers", type=int, default=50, help="transformer blocks (default 50, full depth)")
    parser.add_argument("--batch", type=int, default=1, help="samples per call (default 1)")
    parser.add_argument("--measures", default=",".join(MEASURES), help="forward,step")


def _host_ms(fn, repeats: int) -> dict:
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return harness._stats(samples)


def main(argv=None) -> int:
    from flowlock.models.minimax_h3.tiny import TINY_H3_CONFIG, full_width_config, tiny_inputs

    args = harness.parse_args(__doc__.splitlines()[0], argv, _extra, iters=20, warmup=2)
    measures = [m for m in args.measures.split(",") if m]
    unknown = sorted(set(measures) - set(MEASURES))
    if unknown:
        raise SystemExit(f"--measures: unknown {', '.join(unknown)}; choose from {', '.join(MEASURES)}")
    device = torch.device(args.device)
    gate = harness.gate_or_exit(args, list(GATE_TESTS))
    torch.backends.cuda.matmul.allow_tf32 = False
    if args.smoke:
        config, seq, text_rows = dict(TINY_H3_CONFIG), 64, 4
    else:
        config = full_width_config(num_layers=args.layers, num_refiner_layers=REFINER_LAYERS)
        seq, text_rows = args.seq, TEXT_ROWS
    model = build_model(config, device)
    handle = flowlock.patch(model, mode="strict")
    inputs = tiny_inputs(args.batch, seed=seq, config=config, packing=model_packing(seq, text_rows), device=device)
    latents = [(n, inputs[n]) for n in LATENTS]
    cots = bench_block.cotangents_for(model, inputs)
    calls = {"forward": lambda: bench_block._outputs(model, inputs, "strict"),
             "step": lambda: bench_block._fwd_bwd(model, inputs, cots, "strict")}

    def off(call):
        def run(_):
            with flowlock.nonfinite_check(False):
                call()
        return run

    def reset():
        model.zero_grad(set_to_none=True)

    payload = {"benchmark": "nonfinite", "smoke": args.smoke, "config": config, "seq": seq, "batch": args.batch,
               "latent_elements": {n: t.numel() for n, t in latents}, "gate": gate,
               "environment": harness.environment(device),
               "method": "same process; forward / step timed with the non-finite check on (a) and off (b, "
                         "flowlock.nonfinite_check(False)), order alternating, CUDA events, median of iters after "
                         "warm-up; check alone from an idle device; model check host perf_counter",
               "check": {"median_ms": harness.median_ms(lambda: check_finite_samples(latents), device=device,
                                                        repeats=max(args.iters, harness.MIN_ITERS))},
               "model_check": _host_ms(lambda: check_model(model, device), max(args.iters, harness.MIN_ITERS) * 5),
               "rows": {}}
    try:
        for m in measures:
            with torch.no_grad() if m == "forward" else torch.enable_grad():
                call = calls[m]
                timed = harness.time_pair(lambda _, call=call: call(), off(call), device=device, setup_a=reset,
                                          setup_b=reset, iters=args.iters, warmup=args.warmup)
            payload["rows"][m] = {"on": timed["a"], "off": timed["b"], "ratio_on_over_off": timed["ratio_a_over_b"],
                                  "check_share_of_off": payload["check"]["median_ms"] / timed["b"]["median_ms"]}
            print(f"{m}: on {timed['a']['median_ms']:.2f} ms, off {timed['b']['median_ms']:.2f} ms, "
                  f"ratio {timed['ratio_a_over_b']:.4f}", flush=True)
            harness.write_json(args.out, payload)
    finally:
        handle.remove()
    check_ms, model_ms = payload["check"]["median_ms"], payload["model_check"]["median_ms"]
    print(f"check alone {check_ms:.3f} ms, model check {model_ms:.3f} ms")
    print(f"wrote {harness.write_json(args.out, payload)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
