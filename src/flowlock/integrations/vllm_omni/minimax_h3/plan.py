"""The patch plan for one vLLM-Omni ``MiniMaxH3DiTModel`` instance, as data.

Patched (the ``forward`` of each, replaced by its mode-aware strict forward): the model, every
DiT block, the token refiner and each of its blocks, the time embedder, the final layer, and the
linears the root forward calls directly (the patch and condition projections, the two output
heads). The root reaches them through ``__call__``, as vLLM-Omni does, so a module called on its
own also runs strict. Parameters, buffers and the module tree are untouched.
"""

from __future__ import annotations

from vllm_omni.diffusion.models.minimax_h3.minimax_h3_transformer import (
    MiniMaxH3DiTBlock,
    MiniMaxH3DiTModel,
    MiniMaxH3FinalLayer,
    MiniMaxH3TimeEmbedder,
    MiniMaxH3TokenRefiner,
    MiniMaxH3TokenRefinerBlock,
)

from flowlock.integrations.vllm_omni.minimax_h3 import forward as strict
from flowlock.integrations.vllm_omni.minimax_h3.coverage import NativeRun
from flowlock.integrations.vllm_omni.minimax_h3.sequence_parallel import ATTRIBUTE as SP_ATTRIBUTE
from flowlock.integrations.vllm_omni.minimax_h3.sequence_parallel import NativeUlysses
from flowlock.integrations.vllm_omni.minimax_h3.tensor_parallel import ATTRIBUTE as TP_ATTRIBUTE
from flowlock.integrations.vllm_omni.minimax_h3.tensor_parallel import NativeTensorParallel
from flowlock.models.common.patched_forward import make_patched_forward
from flowlock.models.common.run_context import active_run
from flowlock.patching import PatchEntry, PatchHandle

_LINEARS = ("video_patch_proj", "audio_patch_proj", "condition_proj", "final_layer.video_out",
            "final_layer.audio_out")


def _model_call(model, arguments, stock):
    return strict.model_forward(model, arguments["kwargs"], stock)


def _module_call(strict_fn):
    def call(module, arguments, stock):
        run = active_run() or NativeRun.for_module(module)
        if run.runs_own(module):
            return stock()
        return strict_fn(run, module, **arguments)
    return call


def _linear_call(module, arguments, stock):
    run = active_run() or NativeRun.for_module(module)
    if run.runs_own(module):
        return stock()
    (x,) = arguments.values()
    y = strict.linear_forward(run, module, x)
    return (y, None) if module.return_bias else y


def build_plan(model: MiniMaxH3DiTModel, handle: PatchHandle) -> list[PatchEntry]:
    """The entries routing ``model`` through the strict path under ``handle.mode``; each original
    forward (an instance-level one included) is read now: provider mode calls it, ``remove()``
    restores it. The model's layout is set up first: Ulysses (``ulysses_degree > 1``) or TP > 1
    (:class:`NativeUlysses`, :class:`NativeTensorParallel`, which raise ValueError for a layout the
    strict path refuses); every patched module then carries it, so a module called on its own sees
    the layout too; ``remove()`` drops it."""
    sequence_parallel = NativeUlysses.for_model(model)
    tensor_parallel = NativeTensorParallel.for_model(model)
    targets = [("", model, MiniMaxH3DiTModel, _model_call),
               ("token_refiner", model.token_refiner, MiniMaxH3TokenRefiner, _module_call(strict.refiner_forward))]
    targets += [(f"token_refiner.blocks.{i}", block, MiniMaxH3TokenRefinerBlock,
                 _module_call(strict.refiner_block_forward)) for i, block in enumerate(model.token_refiner.blocks)]
    targets += [(f"blocks.{i}", block, MiniMaxH3DiTBlock, _module_call(strict.block_forward))
                for i, block in enumerate(model.blocks)]
    targets.append(("time_embedder", model.time_embedder, MiniMaxH3TimeEmbedder,
                    _module_call(strict.time_embedder_forward)))
    targets.append(("final_layer", model.final_layer, MiniMaxH3FinalLayer, _module_call(strict.final_layer_forward)))
    # untyped: another layer in a linear slot (a LoRA wrapper) is for coverage to name at forward time
    targets += [(name, model.get_submodule(name), None, _linear_call) for name in _LINEARS]
    entries = [PatchEntry(name, "forward", make_patched_forward(module, module.forward, handle, call), kind)
               for name, module, kind, call in targets]
    for attribute, layout in ((TP_ATTRIBUTE, tensor_parallel), (SP_ATTRIBUTE, sequence_parallel)):
        if layout is not None:
            entries += [PatchEntry(name, attribute, layout, kind) for name, _, kind, _ in targets]
    return entries
