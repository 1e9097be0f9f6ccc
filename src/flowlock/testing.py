"""Test utilities: bitwise asserts, the batch-invariance and repeatability harnesses, FP64 budgets.

Invariance and repeatability are bitwise: tensors are compared through their integer views, so
``+0`` and ``-0`` differ and equal NaN payloads match. Accuracy is judged against an FP64 golden
with a budget derived from the data: at most ``factor`` times the error of a baseline computed in
the provider's own precision, plus one unit of rounding of the output dtype at the golden's scale.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch

_INT_VIEW = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
}

Outputs = torch.Tensor | Sequence[torch.Tensor]


def _as_tuple(x: Outputs) -> tuple[torch.Tensor, ...]:
    return (x,) if isinstance(x, torch.Tensor) else tuple(x)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bits (``+0 != -0``)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    view = _INT_VIEW.get(a.dtype)
    if view is None:
        return torch.equal(a, b)
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))


def mismatch_count(a: torch.Tensor, b: torch.Tensor) -> int:
    """Number of elements whose bits differ (shapes must match)."""
    view = _INT_VIEW.get(a.dtype)
    if view is None:
        return int((a != b).sum())
    return int((a.contiguous().view(view) != b.contiguous().view(view)).sum())


def assert_bitwise_equal(actual: Outputs, expected: Outputs, what: str = "") -> None:
    """Assert every tensor pair is bitwise equal, naming the first that is not."""
    actual, expected = _as_tuple(actual), _as_tuple(expected)
    assert len(actual) == len(expected), f"{what}: {len(actual)} outputs vs {len(expected)}"
    for i, (a, b) in enumerate(zip(actual, expected)):
        if not bitwise_equal(a, b):
            detail = (f"shape {tuple(a.shape)}/{a.dtype} vs {tuple(b.shape)}/{b.dtype}"
                      if a.shape != b.shape or a.dtype != b.dtype
                      else f"{mismatch_count(a, b)} of {a.numel()} elements differ, "
                           f"max |diff| {(a.double() - b.double()).abs().max().item():.3e}")
            raise AssertionError(f"{what} output {i} not bitwise equal: {detail}")


def _take(pool: Outputs, rows: Sequence[int]) -> tuple[torch.Tensor, ...]:
    index = torch.tensor(list(rows), dtype=torch.long)
    return tuple(t.index_select(0, index.to(t.device)).contiguous() for t in _as_tuple(pool))


def batch_invariance_failures(
    fn: Callable[..., Outputs],
    pool: Outputs,
    sizes: Sequence[int] = (2, 3, 7, 16),
    seed: int = 0,
) -> list[str]:
    """Run ``fn`` on each sample alone and inside batches; return a description of every mismatch.

    ``pool`` is a tensor or tuple of tensors whose dim 0 indexes samples; ``fn`` takes the batch
    slices as positional arguments and returns tensors whose dim 0 indexes the same samples. Each
    size ``b`` is run as a random subset in random order, as the first ``b`` samples, and as those
    samples reversed.
    """
    n = _as_tuple(pool)[0].shape[0]
    if max(sizes) > n:
        raise ValueError(f"pool holds {n} samples, fewer than the largest batch {max(sizes)}")
    alone = {}
    failures: list[str] = []
    rng = random.Random(seed)

    def alone_out(i: int) -> tuple[torch.Tensor, ...]:
        if i not in alone:
            alone[i] = tuple(o[0] for o in _as_tuple(fn(*_take(pool, [i]))))
        return alone[i]

    for b in sizes:
        orders = {
            "random": rng.sample(range(n), b),
            "first": list(range(b)),
            "reversed": list(range(b))[::-1],
        }
        for label, rows in orders.items():
            outs = _as_tuple(fn(*_take(pool, rows)))
            for pos, i in enumerate(rows):
                for k, (o, ref) in enumerate(zip(outs, alone_out(i))):
                    if not bitwise_equal(o[pos], ref):
                        failures.append(f"batch {b} ({label}) position {pos} sample {i} output {k}: "
                                        f"{mismatch_count(o[pos], ref)} elements differ")
    return failures


def assert_batch_invariant(fn: Callable[..., Outputs], pool: Outputs,
                           sizes: Sequence[int] = (2, 3, 7, 16), seed: int = 0) -> None:
    """Assert :func:`batch_invariance_failures` finds nothing."""
    failures = batch_invariance_failures(fn, pool, sizes, seed)
    assert not failures, "not batch-invariant:\n" + "\n".join(failures[:10])


def repeat_failures(fn: Callable[[], Outputs], runs: int = 20) -> list[str]:
    """Call ``fn`` ``runs`` times; list every run whose outputs differ bitwise from the first."""
    first = tuple(t.clone() for t in _as_tuple(fn()))
    failures = []
    for r in range(1, runs):
        for k, (o, ref) in enumerate(zip(_as_tuple(fn()), first)):
            if not bitwise_equal(o, ref):
                failures.append(f"run {r} output {k}: {mismatch_count(o, ref)} elements differ")
    return failures


def assert_repeatable(fn: Callable[[], Outputs], runs: int = 20) -> None:
    """Assert ``fn`` gives the same bits on every one of ``runs`` calls."""
    failures = repeat_failures(fn, runs)
    assert not failures, "not repeatable:\n" + "\n".join(failures[:10])


def max_abs_error(actual: torch.Tensor, golden: torch.Tensor) -> float:
    """``max |actual - golden|`` in float64 (NaN if either holds a NaN)."""
    diff = (actual.double() - golden.double()).abs()
    if torch.isnan(diff).any():
        return float("nan")
    return diff.max().item() if diff.numel() else 0.0


def golden_budget(golden: torch.Tensor, out_dtype: torch.dtype, baseline: torch.Tensor | None = None,
                  factor: float = 2.0) -> float:
    """``factor * err(baseline) + eps(out_dtype) * max|golden|``: the data-derived error budget.

    ``baseline`` is the same computation done the provider's way (eager PyTorch in the model's own
    precision); without one the budget is one rounding unit of ``out_dtype`` at the golden's scale.
    """
    scale = golden.double().abs().max().item() if golden.numel() else 0.0
    floor = torch.finfo(out_dtype).eps * scale
    base = max_abs_error(baseline, golden) if baseline is not None else 0.0
    return factor * base + floor


def assert_within_budget(actual: torch.Tensor, golden: torch.Tensor, *, out_dtype: torch.dtype | None = None,
                         baseline: torch.Tensor | None = None, factor: float = 2.0, what: str = "") -> None:
    """Assert ``actual`` is within :func:`golden_budget` of the FP64 ``golden``."""
    out_dtype = out_dtype or actual.dtype
    err = max_abs_error(actual, golden)
    budget = golden_budget(golden, out_dtype, baseline, factor)
    assert err == err, f"{what}: NaN in output"
    assert err <= budget, f"{what}: max |err| {err:.3e} exceeds budget {budget:.3e}"


def assert_raise_before_launch(calls: Sequence[tuple[type[Exception], str, Callable[[], object]]],
                               inputs: Sequence[torch.Tensor]) -> None:
    """Each ``(error, pattern, call)`` raises ``error`` matching ``pattern``, and every tensor in
    ``inputs`` keeps its bits: a rejected call must fail before any kernel touches memory."""
    import pytest

    before = [t.clone() for t in inputs]
    for error, pattern, call in calls:
        with pytest.raises(error, match=pattern):
            call()
    for t, b in zip(inputs, before):
        assert_bitwise_equal(t, b, "input after a rejected call")


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` with NaN (floating) or the dtype's minimum (integer) so unwritten reads show.

    The fill is not recorded by autograd: ``t`` may be a fresh leaf that requires grad (torch 2.11's
    non-reentrant checkpoint allocates one with ``torch.empty(..., requires_grad=True)``)."""
    with torch.no_grad():
        if t.is_floating_point():
            return t.fill_(float("nan"))
        if t.dtype == torch.bool:
            return t.fill_(True)
        return t.fill_(torch.iinfo(t.dtype).min)
