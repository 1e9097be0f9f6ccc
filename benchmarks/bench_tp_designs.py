"""Issue 14's two designs for vLLM-Omni's K-sharded GEMMs, timed on one GPU: what each rank computes.

vLLM-Omni shards K of ``out_proj`` (K = 7168) and ``fc2`` (K = 14336), both to n = 5376, and all-reduces
the partial sums, which changes the K reduction with TP. For TP = N in {1, 2, 4, 8} and S tokens, one
rank's arithmetic under each design is timed here on the GPU it would run on (bf16, CUDA events,
``harness.time_rounds``: every design in the same rounds, first one rotating):

* ``stock``: cuBLAS ``F.linear`` of the rank's K / N columns over all S rows (then a bf16 all-reduce);
* ``a`` (transpose instead of reduce; ``flowlock.parallel.tensor_parallel.k_sharded_linear``): flowlock's
  strict ``linear`` with the whole K over the rank's ceil(S / N) rows; at N = 1 this is the plain strict
  GEMM, so TP = 1 pays nothing;
* ``b`` (canonical K units folded in one fixed tree, TBIK / IsoExec style): K cut into 8 units (TP <= 8),
  the rank's 8 / N units each a strict GEMM over all S rows with an fp32 output, then, for the rank's
  S / N rows, the 8 units' partials summed in ``flowlock.parallel.sample_tree.tree_sum``'s tree and
  rounded once. TP = 1 must run the same 8 units and fold to give the same bits.

``b_over_strict_at_tp1`` is what design (b) costs TP = 1 (the issue asks for none). Bytes each rank
receives come from ``benchmarks/tp_traffic.py`` (counted, not measured: one GPU has no wire). The design
(a) rows are also checked: the rank's rows equal the TP = 1 GEMM's rows bitwise.

Run: ``PYTHONPATH=src python benchmarks/bench_tp_designs.py --out benchmarks/results/tp_designs.json``
(``--smoke``: tiny shapes on CPU, the reference backend, to check the script).
"""

from __future__ import annotations

import harness
import torch
import torch.nn.functional as F
import tp_traffic

from flowlock.ops.linear import linear
from flowlock.parallel.sample_tree import tree_sum

UNITS = 8
TPS = (1, 2, 4, 8)
FULL = {"gemms": {"out_proj": tp_traffic.INNER, "fc2": tp_traffic.FFN}, "n": tp_traffic.HIDDEN,
        "seq": (925, 4253, 16384)}
SMOKE = {"gemms": {"out_proj": 64, "fc2": 128}, "n": 48, "seq": (40,)}


def _operands(seq: int, k: int, n: int, device: torch.device):
    gen = torch.Generator(device=device).manual_seed(seq + k)
    x = torch.randn(seq, k, device=device, generator=gen).to(torch.bfloat16)
    w = (torch.randn(n, k, device=device, generator=gen) / k**0.5).to(torch.bfloat16)
    return x, w


def rank_work(x: torch.Tensor, w: torch.Tensor, tp: int) -> dict:
    """Rank 0's arithmetic under each design at TP = ``tp``, as callables of no argument (operands
    sliced and made contiguous here, outside the timed calls, as each rank would hold them)."""
    seq, k = x.shape
    rows = -(-seq // tp)
    k_rank, k_unit = k // tp, k // UNITS
    x_cols, w_cols = x[:, :k_rank].contiguous(), w[:, :k_rank].contiguous()
    x_rows = x[:rows].contiguous()
    units = [(x[:, u * k_unit:(u + 1) * k_unit].contiguous(), w[:, u * k_unit:(u + 1) * k_unit].contiguous())
             for u in range(UNITS // tp)]
    # the partials of the other ranks' units for this rank's rows arrive by all-to-all; here they are
    # stand-ins of the same shape, so the fold does the same work
    received = [torch.randn(rows, w.shape[0], device=x.device, dtype=torch.float32)
                for _ in range(UNITS - len(units))]

    def design_b():
        partials = [linear(xu, wu, out_dtype=torch.float32)[:rows] for xu, wu in units]
        return tree_sum(partials + received).to(torch.bfloat16)

    return {"stock": lambda: F.linear(x_cols, w_cols), "a": lambda: linear(x_rows, w), "b": design_b}


def main(argv=None) -> int:
    args = harness.parse_args(__doc__.splitlines()[0], argv, iters=20, warmup=3)
    device = torch.device(args.device)
    gate = harness.gate_or_exit(args, ["tests/ops/test_linear.py"])
    shapes = SMOKE if args.smoke else FULL
    rows = []
    for seq in shapes["seq"]:
        for gemm, k in shapes["gemms"].items():
            x, w = _operands(seq, k, shapes["n"], device)
            tp1 = linear(x, w)
            for tp in TPS:
                work = rank_work(x, w, tp)
                a_rows_equal = torch.equal(work["a"](), tp1[:-(-seq // tp)])
                timed = harness.time_rounds({name: (lambda _, f=f: f()) for name, f in work.items()}, device=device,
                                            rounds=args.iters, warmup=args.warmup)
                traffic = tp_traffic.per_block(seq, tp) if tp > 1 else None
                rows.append({"S": seq, "gemm": gemm, "K": k, "n": shapes["n"], "tp": tp,
                             **{f"{name}_ms": r["median_ms"] for name, r in timed.items()},
                             "a_rows_equal_tp1_rows": a_rows_equal,
                             "mb_received_per_rank_per_block_both_gemms": traffic})
                print({key: (round(v, 4) if isinstance(v, float) else v) for key, v in rows[-1].items()
                       if key != "mb_received_per_rank_per_block_both_gemms"}, flush=True)
    tp1 = {(r["S"], r["gemm"]): r for r in rows if r["tp"] == 1}
    summary = [{"S": s, "gemm": g, "b_over_strict_at_tp1": r["b_ms"] / r["a_ms"],
                "strict_over_stock_at_tp1": r["a_ms"] / r["stock_ms"]} for (s, g), r in tp1.items()]
    payload = {"benchmark": "tp_designs", "smoke": args.smoke, "gate": gate, "environment": harness.environment(device),
               "units": UNITS, "method": "one GPU, one rank's arithmetic per design; CUDA events, same rounds, "
               "first design rotating; medians; wire bytes counted (benchmarks/tp_traffic.py), not measured",
               "rows": rows, "tp1_cost": summary}
    print(f"wrote {harness.write_json(args.out, payload)}")
    for s in summary:
        print(s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
