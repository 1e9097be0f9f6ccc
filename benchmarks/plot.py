"""Turn benchmark result JSONs into PNG charts (matplotlib, Agg backend).

``python benchmarks/plot.py benchmarks/results/conditioning.json [...] [--out-dir DIR]`` writes
``<name>.png`` next to each JSON (or into ``--out-dir``). Conditioning results give a bar chart of
speedups (diffusers time / flowlock time, forward and backward, idle and queued) per op and shape and a line chart
of speedup against S; block results give strict/provider time ratios and peak memory per S;
linear results give throughput relative to cuBLAS per shape; attention results TFLOP/s against S;
model results give seconds per variant, strict / stock ratios and peak memory against S.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path, dpi: int) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    _pyplot().close(fig)
    return path


def _title(payload: dict) -> str:
    env = payload.get("environment", {})
    commit = (env.get("git_commit") or "?")[:10] + ("+dirty" if env.get("git_dirty") else "")
    where = env.get("gpu") or env.get("device", "?")
    smoke = " [smoke: not a measurement]" if payload.get("smoke") else ""
    return f"{payload.get('benchmark', '?')} on {where}, {commit}{smoke}"


def plot_conditioning(payload: dict, path: Path) -> Path:
    plt = _pyplot()
    rows = payload["results"]
    labels = [f"{r['op']}\nS={r['S']} T={r['T']}" if r["S"] else f"{r['op']}\nT={r['T']}" for r in rows]
    # idle: each call from an idle GPU; queued: behind a GPU spin, as inside a model forward
    phases = [p for p in ("forward", "backward", "forward_queued", "backward_queued") if p in rows[0]]
    fig, (ax_bar, ax_line) = plt.subplots(2, 1, figsize=(max(10, 0.45 * len(rows)), 10))
    xs = range(len(rows))
    width = 0.8 / len(phases)
    for i, phase in enumerate(phases):
        ax_bar.bar([x - 0.4 + (i + 0.5) * width for x in xs], [r[phase]["speedup"] for r in rows], width=width,
                   label=phase.replace("_", " "))
    ax_bar.axhline(1.0, color="black", linewidth=0.8)
    ax_bar.set_yscale("log")
    ax_bar.set_xticks(list(xs), labels, rotation=90, fontsize=6)
    ax_bar.set_ylabel("speedup (diffusers / flowlock)")
    ax_bar.legend()
    ax_bar.set_title(_title(payload), fontsize=9)
    series: dict[tuple[str, int, str], list[tuple[int, float]]] = {}
    for r in rows:
        if r["S"] is None:
            continue
        for phase in ("forward", "backward"):
            series.setdefault((r["op"], r["T"], phase), []).append((r["S"], r[phase]["speedup"]))
    for (op, t, phase), points in sorted(series.items()):
        points.sort()
        ax_line.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                     linestyle="-" if phase == "forward" else "--", label=f"{op} T={t} {phase}")
    ax_line.axhline(1.0, color="black", linewidth=0.8)
    ax_line.set_xscale("log")
    ax_line.set_yscale("log")
    ax_line.set_xlabel("S (rows)")
    ax_line.set_ylabel("speedup (diffusers / flowlock)")
    ax_line.legend(fontsize=6, ncol=2)
    return _save(fig, path, 120)


def plot_block(payload: dict, path: Path) -> Path:
    plt = _pyplot()
    rows = payload["results"]
    seqs = [str(r["S"]) for r in rows]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.5))
    xs = range(len(rows))
    ax_t.bar([x - 0.2 for x in xs], [r["forward"]["strict_over_provider"] for r in rows], width=0.4,
             label="forward")
    ax_t.bar([x + 0.2 for x in xs], [r["forward_backward"]["strict_over_provider"] for r in rows], width=0.4,
             label="forward+backward")
    ax_t.axhline(1.0, color="black", linewidth=0.8)
    ax_t.set_xticks(list(xs), seqs)
    ax_t.set_xlabel("S (rows)")
    ax_t.set_ylabel("time strict / provider")
    ax_t.legend()
    mem = [[(r["peak_memory_bytes"][m] or 0) / 2**30 for r in rows] for m in ("strict", "provider")]
    ax_m.bar([x - 0.2 for x in xs], mem[0], width=0.4, label="strict")
    ax_m.bar([x + 0.2 for x in xs], mem[1], width=0.4, label="provider")
    ax_m.set_xticks(list(xs), seqs)
    ax_m.set_xlabel("S (rows)")
    ax_m.set_ylabel("peak memory (GiB)")
    ax_m.legend()
    fig.suptitle(_title(payload), fontsize=9)
    return _save(fig, path, 120)


def plot_linear(payload: dict, path: Path) -> Path:
    plt = _pyplot()
    cases = payload["cases"]
    fig, ax = plt.subplots(figsize=(max(8, 0.6 * len(cases)), 5))
    labels = [f"{c['shape']}\nM={c['m']}" for c in cases]
    # idle: single calls from an idle device; queued: behind a GPU spin (hatched, when recorded)
    series = [(phase, key) for key in ("ratio_of_cublas_throughput", "ratio_of_cublas_throughput_queued")
              for phase in ("fwd", "dx", "dw") if key in cases[0][phase]]
    width = 0.8 / len(series)
    for i, (phase, key) in enumerate(series):
        queued = key.endswith("queued")
        ax.bar([x - 0.4 + (i + 0.5) * width for x in range(len(cases))], [c[phase][key] for c in cases], width,
               label=phase + (" queued" if queued else ""), color=f"C{i % 3}", hatch="//" if queued else None)
    for target, style in ((0.85, "--"), (0.80, ":")):
        ax.axhline(target, color="black", linestyle=style, linewidth=0.8)
    ax.set_xticks(range(len(cases)), labels, fontsize=8)
    ax.set_ylabel("flowlock / cuBLAS throughput")
    ax.legend()
    fig.suptitle(f"linear on {payload['environment'].get('gpu', '?')}, {str(payload.get('commit', '?'))[:10]} "
                 "(targets: fwd 0.85, dX/dW 0.80)", fontsize=9)
    return _save(fig, path, 110)


def plot_attention(payload: dict, path: Path) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, phase in zip(axes, ("fwd", "bwd")):
        rows = [r for r in payload["timings"] if r["phase"] == phase]
        for i, impl in enumerate(sorted({r["impl"] for r in rows})):
            # solid: single calls from an idle device; dashed: queued behind a GPU spin (throughput)
            for key, style, suffix in (("tflops", "-", ""), ("tflops_queued", "--", " queued")):
                pts = sorted((r["seq"], r[key]) for r in rows if r["impl"] == impl and key in r)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", linestyle=style,
                            color=f"C{i}", label=impl + suffix)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("S")
        ax.set_ylabel("TFLOP/s")
        ax.set_title(phase)
        ax.legend(fontsize=8)
    fig.suptitle(f"attention (B=1, {payload['heads']} heads, D={payload['dim']}) on {payload.get('gpu', '?')}, "
                 f"{str(payload.get('commit', '?'))[:10]}", fontsize=9)
    return _save(fig, path, 110)


def plot_model(payload: dict, path: Path) -> Path:
    plt = _pyplot()
    rows = payload["rows"]
    fig, (ax_t, ax_r, ax_m) = plt.subplots(1, 3, figsize=(15, 4.5))

    def series(measure: str, key: str) -> tuple[list[int], list[float]]:
        # a variant that failed or was not run has None: its point is left out
        points = sorted((r["S"], r[key]) for r in rows if r["measure"] == measure and r.get(key) is not None)
        return [p[0] for p in points], [p[1] for p in points]

    for measure, style in (("step", "-"), ("forward", "--")):
        for i, variant in enumerate(("strict_eager", "strict_compiled", "strict_graphed", "stock_eager",
                                     "stock_compiled", "stock_graphed", "stock_compiled_graphed")):
            xs, ys = series(measure, f"{variant}_s")
            if xs:
                ax_t.plot(xs, ys, marker="o", linestyle=style, color=f"C{i}", label=f"{variant} {measure}")
        for i, key in enumerate(("strict_over_stock_compiled", "strict_over_stock_eager", "strict_over_best_stock")):
            xs, ys = series(measure, key)
            if xs:
                ax_r.plot(xs, ys, marker="o", linestyle=style, color=f"C{i + 7}",
                          label=f"{key.replace('strict_over_', 'strict / ').replace('_', ' ')} {measure}")
    ax_t.set_xscale("log")
    ax_t.set_yscale("log")
    ax_t.set_ylabel("seconds (median)")
    ax_r.axhline(1.0, color="black", linewidth=0.8)
    ax_r.axhline(0.9, color="black", linestyle=":", linewidth=0.8)
    ax_r.set_xscale("log")
    ax_r.set_ylabel("time, strict (fastest variant) / stock")
    for i, key in enumerate(("strict_peak_gib", "stock_peak_gib")):
        xs, ys = series("step", key)
        if xs:
            ax_m.plot(xs, ys, marker="o", color=f"C{i}", label=key.replace("_peak_gib", " step"))
    ax_m.set_xscale("log")
    ax_m.set_ylabel("peak memory (GiB)")
    seqs = sorted({r["S"] for r in rows})
    for ax in (ax_t, ax_r, ax_m):
        ax.set_xticks(seqs, [str(s) for s in seqs])
        ax.tick_params(axis="x", which="minor", bottom=False, labelbottom=False)
        ax.set_xlabel("S (rows)")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(_title(payload), fontsize=9)
    return _save(fig, path, 120)


def plot_tp_designs(payload: dict, path: Path) -> Path:
    """One panel per K-sharded GEMM: one rank's time under each design against TP, one line per S."""
    plt = _pyplot()
    rows = payload["rows"]
    gemms = list(dict.fromkeys(r["gemm"] for r in rows))
    fig, axes = plt.subplots(1, len(gemms), figsize=(6 * len(gemms), 4.5), squeeze=False)
    seqs = sorted({r["S"] for r in rows})
    for ax, gemm in zip(axes[0], gemms):
        for j, seq in enumerate(seqs):
            picked = sorted((r for r in rows if r["gemm"] == gemm and r["S"] == seq), key=lambda r: r["tp"])
            tps = [r["tp"] for r in picked]
            for design, style in (("stock", ":"), ("a", "-"), ("b", "--")):
                ax.plot(tps, [r[f"{design}_ms"] for r in picked], marker="o", linestyle=style, color=f"C{j}",
                        label=f"S={seq} {design}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(TPS_TICKS, [str(t) for t in TPS_TICKS])
        ax.set_xlabel("TP")
        ax.set_ylabel("one rank's GEMM time (ms, median)")
        ax.set_title(f"{gemm}: stock (dotted), (a) transpose (solid), (b) K units (dashed)", fontsize=8)
        ax.legend(fontsize=6, ncol=3)
    fig.suptitle(_title(payload), fontsize=9)
    return _save(fig, path, 120)


def plot_launch_host(payload: dict, path: Path) -> Path:
    """Host microseconds per GEMM launcher call, per shape and product: prepared launch vs Triton's."""
    plt = _pyplot()
    labels, prepared, triton = [], [], []
    for row in payload["rows"]:
        for product in ("forward", "dx", "dw"):
            labels.append(f"{row['shape']} {product}")
            prepared.append(row[product]["prepared_us"])
            triton.append(row[product]["triton_us"])
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(labels)), 4.5))
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], triton, width=0.4, label="Triton's launch")
    ax.bar([x + 0.2 for x in xs], prepared, width=0.4, label="prepared launch")
    ax.set_xticks(list(xs), labels, rotation=45, ha="right", fontsize=7)
    ax.set_ylabel(f"host us per call (median), M = {payload['settings']['m']}")
    ax.legend(fontsize=7)
    fig.suptitle(_title(payload), fontsize=9)
    fig.tight_layout()
    return _save(fig, path, 120)


def plot_memory_bound(payload: dict, path: Path) -> Path:
    """Each memory-bound op and phase as a share of a copy of its bytes (1.0: as fast as the copy),
    one bar per token count."""
    plt = _pyplot()
    seqs = payload["settings"]["seqs"]
    labels = list(dict.fromkeys(f"{r['op']} {r['phase']}" for r in payload["rows"]))
    share = {(f"{r['op']} {r['phase']}", r["S"]): r["of_copy"] for r in payload["rows"]}
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(labels)), 4.5))
    width = 0.8 / len(seqs)
    for i, s in enumerate(seqs):
        xs = [x + (i - (len(seqs) - 1) / 2) * width for x in range(len(labels))]
        ax.bar(xs, [share.get((label, s), 0.0) for label in labels], width=width, label=f"S = {s}")
    ax.axhline(1.0, color="k", linewidth=0.8)
    ax.set_xticks(list(range(len(labels))), labels, rotation=45, ha="right", fontsize=7)
    ax.set_ylabel("copy time of the same bytes / op time")
    ax.legend(fontsize=7)
    fig.suptitle(_title(payload), fontsize=9)
    return _save(fig, path, 120)


TPS_TICKS = (1, 2, 4, 8)
PLOTTERS = {"conditioning": plot_conditioning, "block": plot_block, "linear": plot_linear,
            "attention": plot_attention, "model": plot_model, "tp_designs": plot_tp_designs,
            "launch_host": plot_launch_host, "memory_bound": plot_memory_bound}


def _kind(payload: dict) -> str | None:
    # bench_attention's JSON predates the shared harness and carries no "benchmark" key.
    return payload.get("benchmark") or ("attention" if "timings" in payload and "heads" in payload else None)


def plot(json_path: Path, out_dir: Path | None = None) -> Path:
    """Draw one result JSON; returns the PNG path. ``ValueError`` for an unknown benchmark kind."""
    payload = json.loads(Path(json_path).read_text())
    kind = _kind(payload)
    if kind not in PLOTTERS:
        raise ValueError(f"{json_path}: no plot for benchmark kind {kind!r} (known: {sorted(PLOTTERS)})")
    out = (out_dir or Path(json_path).parent) / (Path(json_path).stem + ".png")
    out.parent.mkdir(parents=True, exist_ok=True)
    return PLOTTERS[kind](payload, out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="plot benchmark result JSONs")
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    for path in args.results:
        print(f"wrote {plot(path, args.out_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
