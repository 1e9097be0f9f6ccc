"""``flowlock trace --layout``: the first module, and the ranks, whose bits differ between two layouts.

Both parallel layouts run one forward and backward of the tiny H3 (a batch of 2,
:func:`flowlock.validate.layout_models.traced_batch`) as gloo subprocess jobs of this machine
(:func:`flowlock.validate.layout_launch.launch` of :func:`flowlock.validate.layout_worker.trace_layout`,
the two jobs at once); a job whose rank fails raises :class:`LayoutJobFailed`, naming the rank that
failed first, its exception and where it was raised. Every rank records every
module's output and the gradient of every module output that receives one
(:func:`flowlock.validate.trace.capture_step`), plus the latent input gradients, and writes them with
its place in the layout: its data-parallel samples and its Ulysses rows.

The reference layout is one process (``ulysses=1``), so every tensor it records is whole. Each rank's
tensor is compared with the reference rows it stands for: a dimension where the rank holds
``seq_len`` rows' shard (its ``torch.tensor_split`` block) is cut to that block, dimension 0 of a
batched tensor under data parallelism to the rank's samples, and a tensor of the reference's shape
is compared whole (replicated regions). Records are taken in the reference's execution order, forward
first (completion order: a module's children before it), then backward (the order autograd produced
the gradients); the first record that differs on any rank is reported with every rank whose bits
differ there, and the full-sequence rows and samples where they do. A record missing on a rank, or a
shape that maps to no reference rows, is a ``structure`` divergence.

Under ``flowlock.patch`` the strict forward calls the blocks, refiner blocks, ``norm_out``, the
refiner's ``final_norm``, ``time_embedder`` and the input / output linears as modules, so a strict
trace localizes a divergence to one of those; provider mode (the stock diffusers path under its own
context-parallel hooks) records every submodule.
"""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path

import torch

from flowlock.validate.layout_launch import Rank, describe_failures, launch, rank_failures, rank_summaries
from flowlock.validate.layout_spec import ONE_PROCESS, ParallelLayout, parse_parallel_layout

MODES = ("strict", "provider")
_INT_VIEW = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16,
             torch.float16: torch.int16}


class LayoutJobFailed(RuntimeError):
    """A rank of a trace job failed: ``jobs`` maps each failed job (``layout`` / ``against``) to its
    layout's name and :func:`~flowlock.validate.layout_launch.rank_failures`; ``str()`` says which rank
    failed first, with what exception, raised where."""

    def __init__(self, jobs: dict[str, tuple[str, list[Rank]]]):
        self.jobs = {key: {"layout": name, "failures": rank_failures(ranks), "ranks": rank_summaries(ranks)}
                     for key, (name, ranks) in jobs.items()}
        lines = []
        for key, job in self.jobs.items():
            lines.append(f"flowlock trace --layout: the {key} job ({job['layout']}, {len(job['ranks'])} gloo "
                         "ranks) failed")
            lines += describe_failures(job["failures"])
        super().__init__("\n".join(lines))


def _run_job(key: str, layout: ParallelLayout, model_degree: int, runs: list[str], out: Path, worker,
             scenario: str, timeout: float, results: dict) -> None:
    out.mkdir(parents=True)
    results[key] = launch(layout.world, scenario, worker=worker, timeout=timeout,
                          args=[str(out), layout.name, str(model_degree), *runs])


def _differs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    view = _INT_VIEW.get(a.dtype)
    if view is None:
        return a != b
    return a.contiguous().view(view) != b.contiguous().view(view)


def _reference_rows(ref: torch.Tensor, got: torch.Tensor, meta: dict) -> tuple[torch.Tensor, int | None] | None:
    """The rows of the one-process ``ref`` that the rank's ``got`` stands for, and the dimension
    holding sequence rows (None: whole); None when ``got``'s shape maps to no rows of ``ref``."""
    if ref.ndim != got.ndim or ref.dtype != got.dtype:
        return None
    view, seq_dim = ref, None
    start, end = meta["rows"]
    for d in range(ref.ndim):
        if ref.shape[d] == got.shape[d]:
            continue
        if d == 0 and ref.shape[0] == meta["batch"] and got.shape[0] == meta["local_batch"]:
            view = view.narrow(0, meta["batch_start"], meta["local_batch"])
        elif seq_dim is None and ref.shape[d] == meta["seq_len"] and got.shape[d] == end - start:
            view, seq_dim = view.narrow(d, start, end - start), d
        else:
            return None
    return view, seq_dim


def _where(mask: torch.Tensor, seq_dim: int | None, meta: dict, batched: bool) -> dict:
    """Full-sequence rows and samples holding differing elements."""
    where = {}
    if seq_dim is not None:
        rows = mask.movedim(seq_dim, 0).reshape(mask.shape[seq_dim], -1).any(dim=1).nonzero().flatten()
        rows = (rows + meta["rows"][0]).tolist()
        where.update(rows=[rows[0], rows[-1]], differing_rows=len(rows))
    if batched and mask.ndim:
        samples = mask.reshape(mask.shape[0], -1).any(dim=1).nonzero().flatten() + meta["batch_start"]
        where["samples"] = samples.tolist()
    return where


def _rank_label(meta: dict) -> dict:
    return {"rank": meta["rank"], **{k: meta[k] for k in ("dp_rank", "ulysses_rank", "tp_rank") if k in meta},
            "shard": meta["rows"]}


def _compare_record(name: str, ref: list[torch.Tensor], got: list[torch.Tensor] | None, meta: dict
                    ) -> dict | None:
    """This rank's difference at one record, or None."""
    if got is None:
        return {**_rank_label(meta), "kind": "structure", "detail": f"{name} not recorded on this rank"}
    if len(got) != len(ref):
        return {**_rank_label(meta), "kind": "structure", "detail": f"{len(got)} outputs, one process {len(ref)}"}
    for k, (a, b) in enumerate(zip(got, ref)):
        mapped = _reference_rows(b, a, meta)
        if mapped is None:
            return {**_rank_label(meta), "kind": "structure", "output": k,
                    "detail": f"shape {tuple(a.shape)} {a.dtype} maps to no rows of one process's "
                              f"{tuple(b.shape)} {b.dtype}"}
        view, seq_dim = mapped
        mask = _differs(a, view)
        if bool(mask.any()):
            diff = (a.double() - view.double()).abs()
            batched = b.ndim > 0 and b.shape[0] == meta["batch"] and seq_dim != 0
            return {**_rank_label(meta), "kind": "values", "output": k, "mismatches": int(mask.sum()),
                    "numel": a.numel(), "max_abs_diff": float(diff.max()),
                    "max_abs_ref": float(view.double().abs().max()), **_where(mask, seq_dim, meta, batched)}
    return None


def _partial(name: str) -> bool:
    from flowlock.models.minimax_h3.context_parallel import PARTIAL_OUTPUT_GRADIENTS

    base = name.split("#")[0].split(":")[0]
    return any(base == m or base.startswith(m + ".") for m in PARTIAL_OUTPUT_GRADIENTS)


def compare(reference: dict, ranks: list[dict]) -> dict:
    """First differing record of each phase between the one-process ``reference`` and every rank of
    the traced layout (each one run as a worker saved it: ``meta``, ``forward``, ``backward``).

    Gradients of the outputs of :data:`~flowlock.models.minimax_h3.context_parallel.PARTIAL_OUTPUT_GRADIENTS`
    (the timestep embedding, consumed by every row) are each rank's partial by contract when the
    layout splits rows or samples; they are listed under ``partial``, not compared."""
    meta = ranks[0]["meta"]
    split = meta["world"] > 1
    report = {"records": {}, "partial": []}
    for phase in ("forward", "backward"):
        ref_records = reference[phase]
        report["records"][phase] = len(ref_records)
        per_rank = [dict(r[phase]) for r in ranks]
        first = None
        for position, (name, ref_tensors) in enumerate(ref_records):
            if phase == "backward" and split and _partial(name):
                report["partial"].append(name)
                continue
            found = [d for r, records in zip(ranks, per_rank)
                     if (d := _compare_record(name, ref_tensors, records.get(name), r["meta"])) is not None]
            if found:
                first = {"phase": phase, "position": position, "module": name, "ranks": found,
                         "kind": "structure" if any(d["kind"] == "structure" for d in found) else "values"}
                break
        if first is None:
            known = {name for name, _ in ref_records}
            extra = [(r["meta"], name) for r in ranks for name, _ in r[phase] if name not in known]
            if extra:
                first = {"phase": phase, "position": len(ref_records), "module": extra[0][1], "kind": "structure",
                         "ranks": [{**_rank_label(extra[0][0]), "kind": "structure",
                                    "detail": "recorded on this rank only, not in one process"}]}
        report[phase] = first
    report["divergence"] = report["forward"] or report["backward"]
    return report


def trace_layouts(layout: str, against: str = ONE_PROCESS.name, *,
                  runs: tuple[tuple[str, int], ...] = (("strict", 25),), timeout: float = 300.0,
                  worker: str | Path | None = None, scenario: str = "trace") -> dict:
    """Trace ``layout`` against ``against`` (one process); a JSON-able report with one entry per run
    of ``runs`` (``(mode, seq_len)``, or ``(mode, seq_len, plant)`` with a ``worker`` that knows the
    plant): ``divergence`` None (no module differs) or the first differing record: ``phase``,
    ``module``, ``position`` and per differing rank its place, mismatch count and differing
    full-sequence rows. ``ok``: no run of mode ``strict`` without a plant differs.

    ``worker`` / ``scenario``: the rank program (default :mod:`flowlock.validate.layout_worker`'s
    ``trace``). Both layouts run every run in one job each, the two jobs at once. Raises ValueError,
    before any job starts, for a layout the trace does not serve or an unknown mode;
    :class:`LayoutJobFailed` when a rank of either job fails.
    """
    for run in runs:
        if run[0] not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {run[0]!r}")
    traced, reference = parse_parallel_layout(layout, "trace"), parse_parallel_layout(against, "trace")
    if reference != ONE_PROCESS:
        raise ValueError(f"--against must be one process ({ONE_PROCESS.name}): each rank's rows are compared with "
                         f"the one-process rows they stand for; got {reference.name!r}")
    names = [":".join(str(part) for part in run) for run in runs]
    results: dict = {}
    layouts = {"against": reference, "layout": traced}
    with tempfile.TemporaryDirectory(prefix="flowlock-trace-") as tmp:
        # Both jobs at once: most of a rank's wall time is importing torch and diffusers.
        model_degree = max(traced.ulysses, 2)
        threads = [threading.Thread(target=_run_job, args=(key, one, model_degree, names, Path(tmp) / key, worker,
                                                           scenario, timeout, results))
                   for key, one in layouts.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        failed = {key: (layouts[key].name, ranks) for key, (ranks, _) in results.items()
                  if any(r.returncode != 0 for r in ranks)}
        if failed:
            raise LayoutJobFailed(failed)
        if len(results) != len(layouts):
            raise RuntimeError(f"flowlock trace --layout: the {', '.join(sorted(set(layouts) - set(results)))} job "
                               "did not start (its error is above)")
        whole = torch.load(Path(tmp) / "against" / "rank0.pt", weights_only=False)
        ranks = [torch.load(Path(tmp) / "layout" / f"rank{r}.pt", weights_only=False) for r in range(traced.world)]
    reports = [{"run": name, "mode": run[0], "seq_len": run[1], "plant": run[2] if len(run) > 2 else None,
                **compare(whole[name], [r[name] for r in ranks])} for name, run in zip(names, runs)]
    ok = all(r["divergence"] is None for r in reports if r["mode"] == "strict" and r["plant"] is None)
    return {"layout": traced.name, "against": reference.name, "world": traced.world,
            "wall_s": round(max(wall for _, wall in results.values()), 1), "runs": reports, "ok": ok}


def describe(report: dict) -> str:
    """Per run: the first differing module and ranks, or that no module differs."""
    lines = [f"flowlock trace --layout {report['layout']} --against {report['against']} ({report['world']} gloo "
             f"ranks against one process, {report['wall_s']} s)"]
    for run in report["runs"]:
        lines.append(f"  {run['mode']}, S={run['seq_len']}{', plant ' + run['plant'] if run['plant'] else ''} "
                     f"({run['records']['forward']} forward and {run['records']['backward']} backward records):")
        div = run["divergence"]
        if div is None:
            lines.append("    no module differs (module outputs, their gradients, latent gradients)")
        else:
            ranks = ", ".join(str(d["rank"]) for d in div["ranks"])
            lines.append(f"    first {div['phase']} divergence at {div['module']} (record {div['position']}) on "
                         f"rank{'s' if len(div['ranks']) > 1 else ''} {ranks}")
            for d in div["ranks"]:
                start, end = d["shard"]
                where = f"rank {d['rank']} (dp {d['dp_rank']}, ulysses {d['ulysses_rank']}, rows [{start}, {end}))"
                if d["kind"] == "structure":
                    lines.append(f"      {where}: structure: {d['detail']}")
                    continue
                rows = ""
                if "differing_rows" in d:
                    first, last = d["rows"]
                    rows = f", {d['differing_rows']} rows differ within full-sequence rows {first}..{last}"
                lines.append(f"      {where}: output {d['output']}: {d['mismatches']}/{d['numel']} elements{rows}, "
                             f"max |diff| {d['max_abs_diff']:.3e} (max |ref| {d['max_abs_ref']:.3e})")
            if run["backward"] is not None and div["phase"] == "forward":
                lines.append(f"    first backward divergence: {run['backward']['module']}")
        if run["partial"]:
            partial = ", ".join(run["partial"])
            lines.append(f"    not compared (each rank's partial by contract): gradients of {partial}")
    return "\n".join(lines)
