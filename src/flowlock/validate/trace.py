"""First-divergence trace: which module's output is the first to differ between two runs of a model.

Two forwards of the same model (two batch compositions, or strict vs provider) run with a forward
hook on every module; each hook keeps a copy of that module's output tensors. Records are kept in
completion order (a module's children complete before it), so the first differing record is the
innermost module where the bits part ways. A module called several times is recorded once per call.

One sample is compared: a tensor whose leading dimension is the run's batch in both runs is sliced
at the sample's position (``sample_a`` / ``sample_b``); a tensor of equal shape in both runs that is
not batched (timestep embeddings, the AdaLN table, rotary angles) is compared whole. With two runs
of the same batch size and the same sample position, every tensor is compared whole.

Under ``flowlock.patch(model, mode="strict")`` the strict root still calls the blocks, refiner
blocks, ``norm_out``, the refiner's ``final_norm``, ``time_embedder`` and the input / output linears
through their ``__call__`` (so their hooks record), but inside a block the flowlock ops replace the
submodules: a strict trace localizes a divergence to a block, not to an op within it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from flowlock.testing import bitwise_equal, mismatch_count


@dataclass(frozen=True)
class Record:
    """The output tensors of one module call, in completion order."""

    name: str
    outputs: tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class Divergence:
    """The first record whose bits differ (``kind`` ``"values"``) or whose structure does
    (``"structure"``: different module order, output count or shapes)."""

    position: int
    module: str
    output: int
    kind: str
    mismatches: int
    numel: int
    max_abs_diff: float
    max_abs_ref: float

    def as_dict(self) -> dict:
        return asdict(self)


def _tensors(value: object) -> list[torch.Tensor]:
    """Every tensor in a module output, depth first (tuples, lists, dicts, diffusers outputs)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def capture(model: torch.nn.Module, run: Callable[[], object]) -> list[Record]:
    """Call ``run()`` with a forward hook on every module of ``model``; return the records.

    Hooks are removed even when ``run`` raises. Outputs are detached copies, so later in-place
    updates cannot change them.
    """
    records: list[Record] = []
    calls: dict[str, int] = {}
    handles = []

    def hook_for(name: str):
        def hook(module, args, output):
            k = calls.get(name, 0)
            calls[name] = k + 1
            label = name if k == 0 else f"{name}#{k}"
            records.append(Record(label, tuple(t.detach().clone() for t in _tensors(output))))
        return hook

    for name, module in model.named_modules():
        handles.append(module.register_forward_hook(hook_for(name or "<root>")))
    try:
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    return records


def capture_step(model: torch.nn.Module, step: Callable[[], object]) -> tuple[list[Record], list[Record]]:
    """Call ``step()`` (a forward with autograd recording, then its backward) with a forward hook on
    every module of ``model``; return the forward records and the backward records.

    Forward records are :func:`capture`'s (completion order, ``name#k`` for a module's ``k``-th call).
    Backward records hold the gradient of each module output that receives one, in the order autograd
    produced them, named after the output: ``name`` for a module's only tensor output, ``name:i`` for
    output ``i`` of several. Hooks are removed even when ``step`` raises.
    """
    forward: list[Record] = []
    backward: list[Record] = []
    calls: dict[str, int] = {}
    handles = []

    def grad_hook(label: str):
        def hook(grad):
            backward.append(Record(label, (grad.detach().clone(),)))
        return hook

    def hook_for(name: str):
        def hook(module, args, output):
            k = calls.get(name, 0)
            calls[name] = k + 1
            label = name if k == 0 else f"{name}#{k}"
            tensors = _tensors(output)
            forward.append(Record(label, tuple(t.detach().clone() for t in tensors)))
            for i, t in enumerate(tensors):
                if t.requires_grad:
                    t.register_hook(grad_hook(label if len(tensors) == 1 else f"{label}:{i}"))
        return hook

    for name, module in model.named_modules():
        handles.append(module.register_forward_hook(hook_for(name or "<root>")))
    try:
        step()
    finally:
        for h in handles:
            h.remove()
    return forward, backward


def _pair(a: torch.Tensor, b: torch.Tensor, batch_a: int, batch_b: int, sample_a: int,
          sample_b: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The two views to compare for one sample, or ``None`` when the shapes cannot correspond."""
    same_layout = batch_a == batch_b and sample_a == sample_b
    if a.shape == b.shape and (same_layout or a.ndim == 0 or a.shape[0] != batch_a):
        return a, b
    if (a.ndim >= 1 and b.ndim >= 1 and a.shape[0] == batch_a and b.shape[0] == batch_b
            and a.shape[1:] == b.shape[1:]):
        return a[sample_a], b[sample_b]
    if a.shape == b.shape:
        return a, b
    return None


def first_divergence(records_a: list[Record], records_b: list[Record], *, batch_a: int, batch_b: int,
                     sample_a: int = 0, sample_b: int = 0) -> Divergence | None:
    """Compare two captures record by record; return the first difference, or ``None``."""
    for pos, (ra, rb) in enumerate(zip(records_a, records_b)):
        if ra.name != rb.name or len(ra.outputs) != len(rb.outputs):
            return Divergence(pos, f"{ra.name} | {rb.name}", 0, "structure", 0, 0, float("nan"), float("nan"))
        for k, (a, b) in enumerate(zip(ra.outputs, rb.outputs)):
            views = _pair(a, b, batch_a, batch_b, sample_a, sample_b)
            if views is None:
                return Divergence(pos, ra.name, k, "structure", 0, a.numel(), float("nan"), float("nan"))
            va, vb = views
            if not bitwise_equal(va, vb):
                diff = (va.double() - vb.double()).abs()
                return Divergence(pos, ra.name, k, "values", mismatch_count(va, vb), va.numel(),
                                  float(diff.max()) if diff.numel() else 0.0,
                                  float(vb.double().abs().max()) if vb.numel() else 0.0)
    if len(records_a) != len(records_b):
        pos = min(len(records_a), len(records_b))
        return Divergence(pos, "<end of one run>", 0, "structure", 0, 0, float("nan"), float("nan"))
    return None


def trace(model: torch.nn.Module, run_a: Callable[[], object], run_b: Callable[[], object], *, batch_a: int,
          batch_b: int, sample_a: int = 0, sample_b: int = 0) -> dict:
    """Run both forwards under hooks and report the first divergence as a JSON-able dict:
    ``{"records": n, "divergence": None | {...}, "output_differs": bool}``, where ``output_differs``
    says whether the sample's model output (the last record, the root's) differs too: a divergence
    inside the model can be rounded away before it reaches the output."""
    records_a = capture(model, run_a)
    records_b = capture(model, run_b)
    div = first_divergence(records_a, records_b, batch_a=batch_a, batch_b=batch_b,
                           sample_a=sample_a, sample_b=sample_b)
    output_differs = div is not None and (
        div.kind == "structure" or first_divergence(records_a[-1:], records_b[-1:], batch_a=batch_a, batch_b=batch_b,
                                                    sample_a=sample_a, sample_b=sample_b) is not None)
    return {"records": len(records_a), "divergence": None if div is None else div.as_dict(),
            "output_differs": output_differs}
