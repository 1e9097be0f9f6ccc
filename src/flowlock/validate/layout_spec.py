"""The parallel layouts of ``flowlock check --layout`` and ``flowlock trace --layout``: one table, one parser.

A *parallel layout* is how ranks split the work: a data-parallel degree ``dp`` times a Ulysses
sequence-parallel degree ``ulysses``, optionally with exact data-parallel gradients. (Not the packed
rows of one sample, :class:`flowlock.models.minimax_h3.H3Packing`, nor a checkpoint's q/k/v
arrangement.) The checks' rank programs, the trace's jobs and the command line's help all read
:data:`PARALLEL_LAYOUTS`; a new layout is a row here plus, for a check, its scenario in
:data:`flowlock.validate.layout_worker.SCENARIOS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Use = Literal["check", "trace"]


@dataclass(frozen=True)
class ParallelLayout:
    """One parallel layout of the tiny H3 on gloo ranks of this machine (``world = dp * ulysses``)."""

    dp: int
    ulysses: int
    exact_dp: bool  # data-parallel gradients summed in flowlock's fixed tree (FSDP2 + exact_data_parallel)
    check: str | None  # the layout worker's scenario that ``check --layout`` runs; None: not checked
    traced: bool  # ``trace --layout`` compares it rank by rank with one process
    checks: str  # what ``check --layout`` establishes, or what the trace runs

    @property
    def world(self) -> int:
        return self.dp * self.ulysses

    @property
    def name(self) -> str:
        """The one spelling: ``ulysses=U``, ``dp=D``, ``dp=D,ulysses=U`` or ``dp=D,exact``."""
        parts = [f"dp={self.dp}"] if self.dp > 1 else []
        if self.ulysses > 1 or (self.dp == 1 and not self.exact_dp):
            parts.append(f"ulysses={self.ulysses}")
        return ",".join(parts + (["exact"] if self.exact_dp else []))

    def serves(self, use: Use) -> bool:
        return self.check is not None if use == "check" else self.traced


_ULYSSES = "Ulysses SP: outputs and gradients vs one process"
_EXACT = "FSDP2 exact DP: a step's parameter gradients vs one process's tree sum"

PARALLEL_LAYOUTS = (
    ParallelLayout(1, 1, False, None, True, "one process: the reference every trace compares with"),
    ParallelLayout(1, 2, False, "ulysses", True, _ULYSSES),
    ParallelLayout(1, 4, False, "ulysses", True, _ULYSSES),
    ParallelLayout(2, 1, False, None, True, "FSDP2 DP, a sample per rank"),
    ParallelLayout(2, 2, False, "fsdp_ulysses", True, "FSDP2 DP x Ulysses SP: outputs and gradients vs one process"),
    ParallelLayout(2, 4, False, None, True, "FSDP2 DP x Ulysses SP"),
    ParallelLayout(2, 1, True, "exact_dp", False, _EXACT),
    ParallelLayout(4, 1, True, "exact_dp", False, _EXACT + "; also DP 2 x Ulysses 2 and nodes of 2"),
)
ONE_PROCESS = PARALLEL_LAYOUTS[0]


def layout_names(use: Use) -> list[str]:
    """The names of the layouts ``use`` (``check`` or ``trace``) serves, in table order."""
    return [layout.name for layout in PARALLEL_LAYOUTS if layout.serves(use)]


def parse_parallel_layout(spec: str, use: Use) -> ParallelLayout:
    """``"dp=D,ulysses=U[,exact]"`` (each part optional and at most once, any order, spaces ignored)
    -> its row of :data:`PARALLEL_LAYOUTS`. Raises ValueError naming the layouts ``use`` serves for a
    spelling that is no row, or a row ``use`` does not serve."""
    degrees, exact = {"dp": 1, "ulysses": 1}, False
    seen = set()
    for part in spec.replace(" ", "").split(","):
        name, equals, value = part.partition("=")
        if name in seen or not (name == "exact" and not equals or name in degrees and value.isdigit()):
            raise ValueError(f"unknown layout {spec!r}; supported: {', '.join(layout_names(use))}")
        seen.add(name)
        if name == "exact":
            exact = True
        else:
            degrees[name] = int(value)
    for layout in PARALLEL_LAYOUTS:
        if (layout.dp, layout.ulysses, layout.exact_dp) == (degrees["dp"], degrees["ulysses"], exact):
            if layout.serves(use):
                return layout
            raise ValueError(f"layout {layout.name!r} has no {use} here; supported: {', '.join(layout_names(use))}")
    raise ValueError(f"unknown layout {spec!r}; supported: {', '.join(layout_names(use))}")


def layout_help(use: Use) -> str:
    """The ``--layout`` help of ``flowlock check`` / ``flowlock trace``, rendered from the table."""
    if use == "check":
        rows = "; ".join(f"{layout.name} ({layout.world} ranks, {layout.checks})"
                         for layout in PARALLEL_LAYOUTS if layout.serves("check"))
        return f"instead: the suite of one parallel layout on gloo subprocesses (tiny H3), one of: {rows}"
    return ("instead: the first module and rank whose bits differ between this parallel layout "
            f"({', '.join(n for n in layout_names('trace') if n != ONE_PROCESS.name)}) and --against, "
            "forward and backward, on gloo subprocesses (tiny H3)")
