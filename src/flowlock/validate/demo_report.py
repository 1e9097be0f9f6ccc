"""``flowlock demo``'s report in plain words: the blocks (lines and :class:`~flowlock.validate.report.Table`
s) drawn from a :func:`flowlock.validate.demo.run_demo` payload. "stock" is diffusers as shipped
(flowlock's ``provider`` mode); "strict" is the model under ``flowlock.patch(model, mode="strict")``.
"""

from __future__ import annotations

from flowlock.validate.batch_trace import BATCH, describe
from flowlock.validate.demo import totals
from flowlock.validate.report import Block, Table


def _yes(flag: bool) -> str:
    return "yes" if flag else "NO"


def _of(count: int, total: int) -> str:
    return f"{count} of {total}"


def _dlogp(value: float) -> str:
    return "0" if value == 0 else f"{value:.1e}"


def _batching(run: dict) -> str:
    return f"{run['replay_micro_batch']} per forward, {run['replay_order']} order"


def chain_blocks(chain: dict) -> list[Block]:
    """The conditioning-chain table, the backward lines and where strict's bits first leave stock's."""
    rows = []
    for ours, theirs in zip(chain["flowlock"]["stages"], chain["provider"]["stages"]):
        rows.append((ours["stage"], _yes(ours["repeat_equal"]), _yes(ours["invariant"]), _yes(theirs["repeat_equal"]),
                     _yes(theirs["invariant"]), _of(ours["chained_mismatches"], ours["numel"]),
                     _of(ours["local_mismatches"], ours["numel"])))
    table = Table(
        f"Conditioning chain (timestep -> AdaLN -> modulation -> final norm), one sample alone and in a batch of "
        f"{chain['batch']} with two more timesteps, {chain['repeats']} runs each",
        ("stage", "strict repeatable", "strict batch-invariant", "stock repeatable", "stock batch-invariant",
         "differs from stock", "differs, fed stock's inputs"),
        tuple(rows), right=frozenset({5, 6}))
    lines: list[Block] = [
        table,
        "(repeatable: the same bits every run; batch-invariant: the sample's bits the same alone and in the batch; "
        "differs: elements where strict's bits are not stock's, each path fed its own earlier stages, or this stage "
        "alone fed stock's)"]
    for name, label in (("flowlock", "strict"), ("provider", "stock")):
        path = chain[name]
        if path["grads"]:
            repeatable = sum(g["repeat_equal"] for g in path["grads"])
            lines.append(f"{label} backward: {repeatable} of {len(path['grads'])} parameter gradients repeatable; "
                         f"input gradient repeatable: {_yes(path['x_grad_repeat_equal'])}, batch-invariant: "
                         f"{_yes(path['x_grad_invariant'])}")
    first = chain["first_drifting_stage"]
    if first is None:
        lines.append("strict's outputs have stock's bits at every stage")
    else:
        entry = next(s for s in chain["flowlock"]["stages"] if s["stage"] == first)
        lines.append(f"strict's outputs first differ from stock's at {first} "
                     f"({_of(entry['chained_mismatches'], entry['numel'])} elements)")
    return lines


def consistency_blocks(runs: list[dict]) -> list[Block]:
    """The rollout-vs-replay table over every replay batching, and the totals per path."""
    strict = runs[0]["strict"]
    rows = []
    for run in runs:
        n = run["strict"]["n_samples"]
        for s, p in zip(run["strict"]["per_step"], run["provider"]["per_step"]):
            rows.append((_batching(run), str(s["step"]),
                         _of(s["velocity_mismatches"], s["velocity_elements"]), _of(s["logp_mismatches"], n),
                         _dlogp(s["max_abs_dlogp"]),
                         _of(p["velocity_mismatches"], p["velocity_elements"]), _of(p["logp_mismatches"], n),
                         _dlogp(p["max_abs_dlogp"])))
    table = Table(
        f"RL rollout vs replay: {strict['n_samples']} samples x {strict['transitions']} CPS steps, "
        f"{strict['seq_len']} rows each; rollout: all {strict['rollout_batch']} samples in one forward; replay, as a "
        "trainer re-reads them with autograd recording: the micro-batches below",
        ("replay micro-batches", "step", "strict velocity", "strict log-probs", "strict max |dlogp|",
         "stock velocity", "stock log-probs", "stock max |dlogp|"),
        tuple(rows), right=frozenset(range(1, 8)))
    lines: list[Block] = [
        table,
        f"(velocity: elements whose bits differ between rollout and replay; log-probs: samples whose "
        f"{strict['log_prob_flavour']}-flavour log-prob bits differ; max |dlogp|: the largest change in a log-prob)"]
    for mode, label in (("strict", "strict"), ("provider", "stock")):
        t = totals(runs, mode)
        lines.append(f"{label + ':':7s} {_of(t['velocity_mismatches'], t['velocity_elements'])} velocity elements "
                     f"and {_of(t['logp_mismatches'], t['log_probs'])} log-probs differ between rollout and replay")
    return lines


def stock_drift_lines(payload: dict) -> list[str]:
    """Where stock's bits change with the batch on this machine, and, where none of that reached
    the rollout-vs-replay numbers, the committed GPU run beside it."""
    trace = payload["trace"]["provider"]
    stages = payload["chain"]["provider"]["stages"]
    found = []
    if trace["divergence"] is not None:
        found.append(f"one sample alone vs in a batch of {BATCH} {describe(trace)}")
    for key, what in (("invariant", "batch-invariant"), ("repeat_equal", "repeatable")):
        failing = [s["stage"] for s in stages if not s[key]]
        if failing:
            found.append(f"the conditioning chain is not {what} at {', '.join(failing)}")
    lines = [f"stock's drift on this machine: {'; '.join(found)}" if found else
             "stock's drift on this machine: none found (the trace and the chain see the same bits alone and "
             "batched)"]
    runs = payload["consistency"]
    if any(not run["provider"]["bitwise_equal"] for run in runs):
        return lines
    batchings = "; ".join(_batching(run) for run in runs)
    lines.append(f"stock agreed bitwise between rollout and replay in every replay batching checked here "
                 f"({batchings}): on this machine its drift did not reach the velocities in these runs.")
    gpu = payload["gpu_evidence"]
    if gpu is None:
        lines.append("The committed GPU run of this demo (benchmarks/results/) is not in this installation; README's "
                     "\"RL demo\" bullet gives its numbers.")
        return lines
    s, p = gpu["strict"], gpu["provider"]
    batchings = "; ".join(f"{mb} per forward, {order} order" for mb, order in gpu["batchings"])
    lines.append(
        f"On a GPU it does. {gpu['gpu']}, {gpu['file']}: {gpu['model']}, {gpu['seq_len']} rows, {gpu['n_samples']} "
        f"samples x {gpu['transitions']} steps, rollout batch {gpu['rollout_batch']}, replay {batchings}; stock: "
        f"{_of(p['velocity_mismatches'], p['velocity_elements'])} velocity elements and "
        f"{_of(p['logp_mismatches'], p['log_probs'])} log-probs differ (max |dlogp| {_dlogp(p['max_abs_dlogp'])}); "
        f"strict: {_of(s['velocity_mismatches'], s['velocity_elements'])} and "
        f"{_of(s['logp_mismatches'], s['log_probs'])}.")
    return lines


def timing_line(timing: dict, device: str) -> str:
    """What the time per RL step measured, both medians and their ratio."""
    rounds, warm = (f"{n} {what}{'s' if n != 1 else ''}" for n, what in ((timing["rounds"], "round"),
                                                                         (timing["warmup"], "warm-up round")))
    line = (f"time per RL step (one forward of all {timing['n_samples']} samples as the rollout, then their replay "
            f"forwards {timing['replay_micro_batch']} sample(s) at a time with autograd recording), median of "
            f"{rounds} after {warm}, the two paths alternating: strict "
            f"{timing['median_s']['strict']:.3f} s, stock {timing['median_s']['provider']:.3f} s; strict / stock = "
            f"{timing['ratio']:.2f} (above 1: strict is slower)")
    if device.startswith("cpu"):
        line += (". On CPU strict runs flowlock's PyTorch reference ops, written to be exact, not fast; on a GPU it "
                 "runs its Triton kernels (README, \"GPU evidence\")")
    return line


def backends_line(backends: list[str]) -> str:
    """The flowlock ops the strict path ran, grouped by backend."""
    by_backend: dict[str, list[str]] = {}
    for entry in backends:
        op, backend = entry.rsplit(":", 1)
        by_backend.setdefault(backend, []).append(op)
    return "flowlock ops in the strict path: " + "; ".join(
        f"{', '.join(ops)} (on the {backend} backend)" for backend, ops in sorted(by_backend.items()))


def demo_blocks(payload: dict) -> list[Block]:
    """The whole demo report, in reading order."""
    blocks: list[Block] = [f"flowlock demo: {payload['model']} on {payload['device']}", ""]
    blocks += chain_blocks(payload["chain"])
    blocks.append("")
    blocks += consistency_blocks(payload["consistency"])
    blocks += stock_drift_lines(payload)
    blocks += ["", timing_line(payload["timing"], payload["device"]), backends_line(payload["backends"]), "",
               f"strict path exactly on-policy here: {_yes(payload['ok'])}"]
    return blocks
