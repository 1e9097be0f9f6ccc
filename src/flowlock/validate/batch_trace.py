"""Where a sample's bits first change between running alone and inside a batch: the
:func:`flowlock.validate.trace.trace` of one H3 sample alone against the same sample at position 1
of a batch of 3, for the strict path and for stock diffusers (``flowlock trace``, ``flowlock demo``,
``flowlock check``)."""

from __future__ import annotations

import flowlock
from flowlock.models.minimax_h3.tiny import tiny_inputs
from flowlock.validate.trace import trace

BATCH, POSITION = 3, 1
_BATCHED_INPUTS = ("hidden_states", "audio_hidden_states", "encoder_hidden_states")


def trace_alone_vs_batched(model, mode: str, batch: int = BATCH, position: int = POSITION) -> dict:
    """:func:`~flowlock.validate.trace.trace` of sample ``position`` of a seeded ``batch`` (tiny H3
    inputs in the model's widths) run alone and in the batch, under ``flowlock.mode(mode)``."""
    device = next(model.parameters()).device
    inputs = tiny_inputs(batch, seed=1, config=dict(model.config), device=device)
    alone = {k: (v[position:position + 1] if k in _BATCHED_INPUTS else v) for k, v in inputs.items()}

    def run(kwargs):
        def call():
            with flowlock.mode(mode):
                return model(**kwargs)
        return call

    return trace(model, run(alone), run(inputs), batch_a=1, batch_b=batch, sample_a=0, sample_b=position)


def run_traces(model) -> dict:
    """Alone-vs-batched traces of ``model``: ``{"strict": ..., "provider": ...}``; strict runs under
    ``flowlock.patch(model, mode="strict")``, removed afterwards."""
    handle = flowlock.patch(model, mode="strict")
    try:
        return {mode: trace_alone_vs_batched(model, mode) for mode in ("strict", "provider")}
    finally:
        handle.remove()


def describe(result: dict) -> str:
    """One trace result in words."""
    div = result["divergence"]
    if div is None:
        return f"no module differs ({result['records']} module outputs compared)"
    if div["kind"] == "structure":
        return f"the runs call different modules at record {div['position']}: {div['module']}"
    reached = ("the model's output differs too" if result["output_differs"]
               else "the model's output is still the same bits")
    which = f"output {div['output']} of " if div["output"] else ""
    return (f"first differs at {which}{div['module']} (module output {div['position'] + 1} of {result['records']} in "
            f"completion order): {div['mismatches']} of {div['numel']} elements, max |diff| {div['max_abs_diff']:.1e} "
            f"(largest value {div['max_abs_ref']:.1e}); {reached}")


def trace_lines(results: dict, subject: str) -> list[str]:
    """``flowlock trace``'s report of :func:`run_traces` ``results`` on ``subject`` (model and device)."""
    return [f"flowlock trace: {subject}, one sample alone vs at position {POSITION} of a batch of {BATCH}",
            f"  strict: {describe(results['strict'])}",
            f"  stock : {describe(results['provider'])}",
            f"  (strict: {results['strict']['records']} module outputs, from the modules the strict forward still "
            "calls as modules; the flowlock ops inside them are not hooked)"]
