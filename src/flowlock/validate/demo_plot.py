"""The demo's PNG: per CPS step, how far the replay is from the rollout, strict and stock.

Three panels, each summed over the demo's replay batchings: velocity elements that differ, log-probs
that differ (counts, axes from 0, integer ticks) and the largest change in a log-prob (log scale,
positive values only: a zero cannot sit on a log axis). A series that is zero at every step is
named "identical (0)" in the legend and written on the panel, so it cannot hide under the other
line; strict is drawn above stock. Needs matplotlib (the ``plot`` extra).
"""

from __future__ import annotations

from pathlib import Path

# (mode, label, colour, marker, line style, z-order): strict last and highest, so it is drawn above stock
SERIES = (("provider", "stock diffusers", "tab:red", "s", "--", 2),
          ("strict", "flowlock strict", "tab:blue", "o", "-", 3))


def _per_step(runs: list[dict], mode: str, key: str, combine) -> list[float]:
    steps = len(runs[0][mode]["per_step"])
    return [combine(run[mode]["per_step"][k][key] for run in runs) for k in range(steps)]


def draw_demo(payload: dict):
    """The figure of a :func:`flowlock.validate.demo.run_demo` payload (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    runs = payload["consistency"]
    steps = [s["step"] for s in runs[0]["strict"]["per_step"]]
    panels = (("velocity_mismatches", sum, "velocity elements that differ"),
              ("logp_mismatches", sum, "log-probs that differ"),
              ("max_abs_dlogp", max, "largest |change in log-prob|"))
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
    for ax, (key, combine, ylabel) in zip(axes, panels):
        counts = key != "max_abs_dlogp"
        for mode, label, color, marker, style, z in SERIES:
            values = _per_step(runs, mode, key, combine)
            zero = all(v == 0 for v in values)
            name = f"{label}: identical (0) at every step" if zero else label
            if counts:
                # clip_on=False: a series at 0 sits on the bottom spine and must not be cut in half by it
                ax.plot(steps, values, marker=marker, linestyle=style, color=color, label=name, zorder=z,
                        markersize=7 if mode == "provider" else 5, linewidth=2.5 if mode == "provider" else 1.5,
                        clip_on=False)
            elif zero:
                ax.plot([], [], marker=marker, linestyle="none", color=color, label=name)  # legend entry only
            else:
                shown = [(s, v) for s, v in zip(steps, values) if v > 0]
                skipped = [str(s) for s, v in zip(steps, values) if v == 0]
                if skipped:
                    name += f" (0 at step {', '.join(skipped)}: not on a log axis)"
                ax.plot(*zip(*shown), marker=marker, linestyle=style, color=color, label=name, zorder=z)
        ax.set_xlabel("CPS step")
        ax.set_xticks(steps)
        ax.set_ylabel(ylabel)
        if counts:
            top = max(max(_per_step(runs, mode, key, combine)) for mode in ("strict", "provider"))
            ax.set_ylim(0, max(1, top) * 1.25)
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        elif any(len(line.get_xdata()) for line in ax.get_lines()):
            ax.set_yscale("log")
        else:
            ax.set_yticks([])
            ax.text(0.5, 0.5, "no log-prob changed", transform=ax.transAxes, ha="center", color="0.4")
        span = max(1, steps[-1] - steps[0])
        ax.set_xlim(steps[0] - 0.08 * span, steps[-1] + 0.08 * span)
        ax.legend(loc="best", fontsize=8)
        ax.grid(alpha=0.3)
    batchings = "; ".join(f"{run['replay_micro_batch']} per forward, {run['replay_order']}" for run in runs)
    strict = runs[0]["strict"]
    fig.suptitle(f"flowlock demo on {payload['device']}: rollout ({strict['rollout_batch']} samples per forward) vs "
                 f"replay ({batchings}), summed over the replay batchings", fontsize=9)
    fig.tight_layout()
    return fig


def plot_demo(payload: dict, path: str | Path) -> Path:
    """Write :func:`draw_demo`'s figure to ``path`` (PNG); returns the path."""
    import matplotlib.pyplot as plt

    fig = draw_demo(payload)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
