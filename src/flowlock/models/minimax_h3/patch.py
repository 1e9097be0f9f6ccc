"""The patched H3 forwards' strict calls: what each patched module computes on the strict path.

Patched: the model itself, and every module its forward calls directly: each transformer block and
token refiner block, ``norm_out``, the refiner's ``final_norm``, ``time_embedder`` and the five input
/ output linears. The root forward reaches them through ``__call__`` so their hooks run as in
diffusers, FSDP2's unsharding included (blocks are FSDP2 units; the FP32 modules must be units of
their own, as FSDP2 wants one dtype per unit). Each is wrapped by
:func:`flowlock.models.common.patched_forward.make_patched_forward`, which picks the mode.
"""

from __future__ import annotations

from flowlock.models.common.run_context import active_run
from flowlock.models.minimax_h3.context_parallel import unsupported_reason as context_parallel_unsupported
from flowlock.models.minimax_h3.strict import (
    Run,
    block_forward,
    norm_out_forward,
    refiner_block_forward,
    strict_forward,
    time_embedder_forward,
)
from flowlock.modes import fallback_or_raise


def strict_model_call(model, arguments, stock):
    attention_kwargs = arguments.pop("attention_kwargs", None)
    if attention_kwargs and attention_kwargs.get("scale", 1.0) != 1.0:
        # diffusers rescales every LoRA layer in place for the call; the strict path does not mutate weights.
        fallback_or_raise("minimax_h3 forward", "a LoRA scale in attention_kwargs is not on the strict path")
        return stock()
    reason = context_parallel_unsupported(model)
    if reason is not None:
        fallback_or_raise("minimax_h3 context parallelism", reason)
        return stock()
    return strict_forward(model, **arguments)


def _module_call(strict_fn):
    def call(module, arguments, stock):
        if arguments.pop("attention_mask", None) is not None:
            fallback_or_raise(f"minimax_h3 {type(module).__name__}", "an attention mask is not on the strict path")
            return stock()
        run = active_run() or Run.for_module(module)
        if run.runs_own(module):
            return stock()
        return strict_fn(run, module, *arguments.values())
    return call


def _one_input_call(strict_fn):
    # Linear, peft LoRA Linear, RMSNorm, TimestepEmbedding: one tensor in; anything more (a
    # TimestepEmbedding condition, peft's adapter_names) is not on the strict path.
    def call(module, arguments, stock):
        (x, *rest) = arguments.values()
        if any(not (v is None or (isinstance(v, (tuple, dict)) and not v)) for v in rest):
            fallback_or_raise(f"minimax_h3 {type(module).__name__}", "extra forward arguments are not on the "
                              "strict path")
            return stock()
        run = active_run() or Run.for_module(module)
        if run.runs_own(module):
            return stock()
        return strict_fn(run, module, x)
    return call


strict_block_call = _module_call(block_forward)
strict_refiner_block_call = _module_call(refiner_block_forward)
strict_norm_out_call = _module_call(norm_out_forward)
strict_linear_call = _one_input_call(lambda run, module, x: run.linear(module, x))
strict_rms_norm_call = _one_input_call(lambda run, module, x: run.rms_norm(module, x))
strict_time_embedder_call = _one_input_call(time_embedder_forward)
