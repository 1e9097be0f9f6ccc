"""Bytes each rank receives and holds per H3 DiT block under vLLM-Omni TP, by design (arithmetic, no run).

``python benchmarks/tp_traffic.py [--tokens S]`` prints, for TP 2, 4 and 8 at H3 widths (hidden 5376,
attention 56 x 128 = 7168, FFN 14336, BF16 activations and weights), the two GEMMs whose K vLLM shards
(``out_proj``, ``fc2``):

* stock: partial GEMMs summed by a ring all-reduce (receives ``2 (N-1)/N · S · n`` elements);
* flowlock (a, gathered weight; what ``flowlock.parallel.tensor_parallel.k_sharded_linear`` does):
  all-to-all to whole-K rows ``(N-1)/N · S · K/N``, all-gather of the output rows ``(N-1)/N · S · n``,
  all-gather of the weight's K blocks ``(N-1)/N · n · K`` per call, nothing held between calls;
* (a) with a held weight replica: the same activations, the weight held instead (``(N-1)/N · n · K``
  more per rank, kept for the whole run);
* (b) canonical K units in one fixed tree (TBIK / IsoExec style), at its cheapest: an all-to-all of
  FP32 partial chunks, a local fixed fold of each chunk, an all-gather of the rounded BF16 chunks
  (``(N-1)/N · S · n`` elements of 4 B plus as many of 2 B); and TP = 1 must fold the same units.

The GEMM FLOPs per rank are ``2 · S · n · K / N`` in every design. Counts only: no GPU was used.
"""

from __future__ import annotations

import argparse

HIDDEN, INNER, FFN = 5376, 56 * 128, 14336
GEMMS = {"out_proj": INNER, "fc2": FFN}  # K of each (n = HIDDEN)
BF16, FP32 = 2, 4


def per_block(tokens: int, n_ranks: int) -> dict[str, float]:
    """MB received per rank per block (and MB of weight replica held) for ``tokens`` rows at TP ``n_ranks``."""
    share = (n_ranks - 1) / n_ranks
    stock = sum(2 * share * tokens * HIDDEN * BF16 for _ in GEMMS)
    rows = sum(share * tokens * (k / n_ranks + HIDDEN) * BF16 for k in GEMMS.values())
    weights = sum(share * HIDDEN * k * BF16 for k in GEMMS.values())
    tree = sum(share * tokens * HIDDEN * (FP32 + BF16) for _ in GEMMS)
    mb = 1e6
    return {"stock": stock / mb, "a_gathered": (rows + weights) / mb, "a_replica": rows / mb,
            "a_replica_held": weights / mb, "b_tree": tree / mb}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 20000, 60000])
    args = parser.parse_args()
    print(f"{'S':>7} {'TP':>3} {'stock':>9} {'(a) gathered':>13} {'(a) replica':>12} {'held':>8} {'(b) tree':>9}"
          "   (MB per rank per block)")
    for tokens in args.tokens:
        for n_ranks in (2, 4, 8):
            r = per_block(tokens, n_ranks)
            print(f"{tokens:>7} {n_ranks:>3} {r['stock']:>9.1f} {r['a_gathered']:>13.1f} {r['a_replica']:>12.1f} "
                  f"{r['a_replica_held']:>8.1f} {r['b_tree']:>9.1f}")


if __name__ == "__main__":
    main()
