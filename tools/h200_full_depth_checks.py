"""The full-depth strict H3 on one GPU is bitwise repeatable and batch-invariant (README, "Full-depth model").

The model of ``benchmarks/bench_model.py`` (50 blocks + 2 refiner blocks, H3's full widths, 33.1B
random-weight parameters drawn on the GPU, BF16 with the FP32 modules, gradient checkpointing, every
parameter trained) under ``flowlock.patch(model, mode="strict")``, at one packed S (default 925;
text 256 rows, audio S // 16, the rest video):

* repeatability: two training steps (forward, backward of fixed random cotangents) of one batch-1
  input. The first step's outputs, latent-input gradients and every parameter gradient are copied to
  host memory (two gradient sets do not fit beside the weights on the GPU), the second step's are
  compared with ``torch.equal``; the names of differing parameters are recorded;
* on CUDA, the step captured as one CUDA graph (``flowlock.models.minimax_h3.graphed.capture_h3``) and
  replayed on the same input: its outputs, latent gradients and every parameter gradient against the
  first eager step's, ``torch.equal``;
* batch invariance: sample 0 alone against sample 0 inside a batch of 2 (its own latents beside a
  second sample's, same layout), the forward's outputs and, from a backward of sample 0's cotangents
  alone, its latent-input gradients, ``torch.equal``.

JSON to ``--out`` with the commit (``FLOWLOCK_COMMIT``), GPU, torch and triton. GPU (one H200, about
4 minutes): ``PYTHONPATH=/tmp/site:src FLOWLOCK_COMMIT=<sha> python3 tools/h200_full_depth_checks.py
--out $OUT/full_depth_checks.json``; ``--tiny --device cpu`` checks the logic on the tiny H3 and the
CPU reference backend.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "src")]

import bench_block  # noqa: E402
import bench_model  # noqa: E402
import harness  # noqa: E402
import torch  # noqa: E402

import flowlock  # noqa: E402

LATENTS = ("hidden_states", "audio_hidden_states", "encoder_hidden_states")


def step(model, inputs: dict, cots) -> dict:
    """One training step; returns outputs and latent gradients (detached) and leaves ``.grad`` set."""
    model.zero_grad(set_to_none=True)
    leaves = {k: (v.clone().requires_grad_() if k in LATENTS else v) for k, v in inputs.items()}
    out = model(**leaves, return_dict=False)
    torch.autograd.backward([out[0], out[1]], list(cots))
    return {"outputs": [out[0].detach(), out[1].detach()], "latent_grads": [leaves[k].grad for k in LATENTS]}


def graphed_step(model, inputs: dict, cots) -> tuple[dict, Callable[[], None]]:
    """The step captured as one CUDA graph (``capture_h3``) and replayed once on ``inputs``: what
    :func:`step` returns, here the graph's own tensors, and the function that releases the graph
    (compare before calling it)."""
    from flowlock.models.minimax_h3.graphed import capture_h3

    def fn(**leaves):
        out = model(**leaves, return_dict=False)
        torch.autograd.backward([out[0], out[1]], list(cots))
        return [out[0].detach(), out[1].detach()]

    model.zero_grad(set_to_none=True)
    leaves = {k: (v.clone().requires_grad_() if k in LATENTS else v) for k, v in inputs.items()}
    captured = capture_h3(model, fn, leaves, warmup=1)
    outputs = captured()
    return {"outputs": outputs, "latent_grads": [captured.input_grads[k] for k in LATENTS]}, captured.release


def _differing(first: dict, host: dict, other: dict, model) -> tuple[list[str], list[str]]:
    """Outputs / latent gradients and parameter gradients of ``other`` (on the device) that differ from
    ``first`` and ``host`` (host copies)."""
    differ = [f"output {i}" for i, (a, b) in enumerate(zip(first["outputs"], other["outputs"]))
              if not torch.equal(a, b.cpu())]
    differ += [f"{k}.grad" for k, a, b in zip(LATENTS, first["latent_grads"], other["latent_grads"])
               if not torch.equal(a, b.cpu())]
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    varying = sorted(n for n in host.keys() | grads.keys()
                     if n not in host or n not in grads or not torch.equal(host[n], grads[n].cpu()))
    return differ, varying


def repeatability(model, inputs: dict, cots) -> dict:
    """Two eager steps, and on CUDA a replay of the step captured as a CUDA graph, against the first."""
    first = step(model, inputs, cots)
    host = {n: p.grad.to("cpu") for n, p in model.named_parameters() if p.grad is not None}
    first = {k: [t.to("cpu") for t in v] for k, v in first.items()}
    differ, varying = _differing(first, host, step(model, inputs, cots), model)
    model.zero_grad(set_to_none=True)
    report = {"outputs_and_latent_grads_repeatable": not differ, "differing": differ, "param_grads": len(host),
              "param_grads_repeatable": len(host) - len(varying), "varying_param_grads": varying[:20]}
    if inputs["hidden_states"].is_cuda:
        replayed, release = graphed_step(model, inputs, cots)
        differ, varying = _differing(first, host, replayed, model)
        release()
        report["graphed_replay"] = {"outputs_and_latent_grads_equal": not differ, "differing": differ,
                                    "param_grads_equal": len(host) - len(varying),
                                    "differing_param_grads": varying[:20]}
    return report


def batch_invariance(model, alone: dict, pair: dict, cots_alone) -> dict:
    a = step(model, alone, cots_alone)
    # the pair's second sample gets zero cotangents: sample 0's latent gradients are then its own
    cots_pair = [torch.cat([c, torch.zeros_like(c)]) for c in cots_alone]
    b = step(model, pair, cots_pair)
    model.zero_grad(set_to_none=True)
    differ = [f"output {i}" for i, (x, y) in enumerate(zip(a["outputs"], b["outputs"])) if not torch.equal(x[0], y[0])]
    differ += [f"{k}.grad" for k, x, y in zip(LATENTS, a["latent_grads"], b["latent_grads"])
               if not torch.equal(x[0], y[0])]
    return {"sample0_alone_equals_in_batch_of_2": not differ, "differing": differ}


def main(argv=None) -> int:
    from flowlock.models.minimax_h3.tiny import TINY_H3_CONFIG, full_width_config, tiny_inputs

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=925)
    parser.add_argument("--layers", type=int, default=50)
    parser.add_argument("--refiner-layers", type=int, default=2)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="the tiny H3's widths, S = 40 (CPU check)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    if args.tiny:
        config = dict(TINY_H3_CONFIG, num_layers=args.layers, num_refiner_layers=args.refiner_layers)
        args.seq, text_rows = 40, 4
    else:
        config = full_width_config(num_layers=args.layers, num_refiner_layers=args.refiner_layers)
        text_rows = bench_model.TEXT_ROWS
    start = time.perf_counter()
    model = bench_model.build_model(config, device)
    handle = flowlock.patch(model, mode="strict")
    layout = bench_model.model_packing(args.seq, text_rows)
    pair = tiny_inputs(2, seed=args.seq, config=config, packing=layout, device=device)
    alone = {k: (v[:1] if k in LATENTS else v) for k, v in pair.items()}
    cots = bench_block.cotangents_for(model, alone)
    report = {"script": "tools/h200_full_depth_checks.py", "environment": harness.environment(device),
              "config": config, "parameters": sum(p.numel() for p in model.parameters()), "seq_len": args.seq,
              "gradient_checkpointing": True, "mode": "strict"}
    try:
        report["repeatability"] = repeatability(model, alone, cots)
        print("repeatability:", report["repeatability"], flush=True)
        report["batch_invariance"] = batch_invariance(model, alone, pair, cots)
        print("batch invariance:", report["batch_invariance"], flush=True)
    finally:
        handle.remove()
        report["wall_s"] = round(time.perf_counter() - start, 1)
        harness.write_json(args.out, report)
    rep = report["repeatability"]
    graphed = rep.get("graphed_replay")
    ok = (rep["outputs_and_latent_grads_repeatable"] and rep["param_grads_repeatable"] == rep["param_grads"]
          and report["batch_invariance"]["sample0_alone_equals_in_batch_of_2"]
          and (graphed is None or (graphed["outputs_and_latent_grads_equal"]
                                   and graphed["param_grads_equal"] == rep["param_grads"])))
    print("ok" if ok else "NOT OK", f"({report['wall_s']} s)", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
