"""The patch plan for one ``MiniMaxH3Transformer3DModel`` instance, as data.

Entries: the instance's ``forward``, and the ``forward`` of every module the strict root forward
calls through ``__call__`` (transformer and refiner blocks, ``norm_out``, the refiner's
``final_norm``, ``time_embedder``, the input and output linears), each replaced by its mode-aware
strict forward from :mod:`flowlock.models.minimax_h3.patch`, wrapped by
:func:`flowlock.models.common.patched_forward.make_patched_forward`. Slots whose module may legitimately
be another type (a peft LoRA layer in a Linear slot) carry no type; strict mode decides per call.
Nothing else changes: parameters, buffers, the FP32 modules and the module tree stay as they are,
so ``state_dict`` is identical while patched. A module whose forward is already wrapped by a diffusers
or accelerate hook is refused (:mod:`flowlock.models.common.diffusers_hooks`): hooks go on after patching.
"""

from __future__ import annotations

from diffusers import MiniMaxH3Transformer3DModel
from diffusers.models.transformers.transformer_minimax_h3 import (
    MiniMaxH3AdaLayerNormOut,
    MiniMaxH3TokenRefinerBlock,
    MiniMaxH3TransformerBlock,
)

from flowlock.models.common.diffusers_hooks import target_hooks
from flowlock.models.common.patched_forward import make_patched_forward
from flowlock.models.minimax_h3.context_parallel import check_layout as check_context_parallel_layout
from flowlock.models.minimax_h3.guards import plan_dtypes
from flowlock.models.minimax_h3.patch import (
    strict_block_call,
    strict_linear_call,
    strict_model_call,
    strict_norm_out_call,
    strict_refiner_block_call,
    strict_rms_norm_call,
    strict_time_embedder_call,
)
from flowlock.modes import StrictModeError
from flowlock.patching import PatchEntry, PatchHandle


def build_plan(model: MiniMaxH3Transformer3DModel, handle: PatchHandle) -> list[PatchEntry]:
    """The entries that route ``model`` through the strict path under ``handle.mode``.

    Raises ValueError for a context-parallel layout no mode can run (a Ulysses degree that does not
    divide the heads), before anything is patched. Each original forward is read now, so a
    pre-existing instance-level ``forward`` (another wrapper) is what provider mode calls and what
    ``remove()`` restores. Raises StrictModeError naming the module and its hooks when a target's
    forward is wrapped by a diffusers or accelerate hook. Raises TypeError naming the module and tensor
    for dtypes the strict path cannot run (:func:`flowlock.models.minimax_h3.guards.plan_dtypes`).
    """
    check_context_parallel_layout(model)
    targets = [("", model, MiniMaxH3Transformer3DModel, strict_model_call)]
    targets += [(f"token_refiner.refiner_blocks.{i}", block, MiniMaxH3TokenRefinerBlock, strict_refiner_block_call)
                for i, block in enumerate(model.token_refiner.refiner_blocks)]
    targets += [(f"transformer_blocks.{i}", block, MiniMaxH3TransformerBlock, strict_block_call)
                for i, block in enumerate(model.transformer_blocks)]
    targets.append(("norm_out", model.norm_out, MiniMaxH3AdaLayerNormOut, strict_norm_out_call))
    targets.append(("token_refiner.final_norm", model.token_refiner.final_norm, None, strict_rms_norm_call))
    targets.append(("time_embedder", model.time_embedder, None, strict_time_embedder_call))
    targets += [(name, model.get_submodule(name), None, strict_linear_call)
                for name in ("proj_in", "audio_proj_in", "context_embedder", "proj_out", "audio_proj_out")]
    for name, module, _, _ in targets:
        if target_hooks(module):
            # Replacing the wrapped forward would drop the hook (an onload, a cast, a device move).
            raise StrictModeError(f"{name or '<root>'} carries hook {', '.join(target_hooks(module))}: call "
                                  "flowlock.patch before enabling diffusers hooks (enable_layerwise_casting, "
                                  "enable_group_offload, enable_model_cpu_offload), which then wrap the strict path")
    plan_dtypes(model)  # TypeError for dtypes the strict path cannot run; records them for call-time checks
    return [PatchEntry(name, "forward", make_patched_forward(module, module.forward, handle, call), kind)
            for name, module, kind, call in targets]
