"""flowlock inside vLLM-Omni: the strict forward of its native DiT models.

``handle = install(model)`` routes a vLLM-Omni model of a family flowlock serves through flowlock's
ops, so a rollout computes the bits the diffusers trainer computes under ``flowlock.patch``;
``handle.remove()`` puts every original forward back. Each family's adapter lives in a wing of its
own (MiniMax-H3's ``MiniMaxH3DiTModel``, vllm-omni 0.30.0: :mod:`.minimax_h3`) and is registered
here by import path, so vLLM, vLLM-Omni and the wing are imported only when :func:`install` meets
a model of that family. Engine-generic pieces stay here: vLLM's layer classes (:mod:`.layers`),
LoRA sync and strict LoRA (:mod:`.lora`), and building a native model in this process
(:mod:`.runtime`).
"""

from __future__ import annotations

from flowlock.patching import PatchHandle, patch_registered

__all__ = ["install"]

# (model class module, class name) -> "package.module:function" building that class's patch plan.
_ADAPTERS = {
    ("vllm_omni.diffusion.models.minimax_h3.minimax_h3_transformer", "MiniMaxH3DiTModel"):
        "flowlock.integrations.vllm_omni.minimax_h3.plan:build_plan",
}


def install(model, mode: str = "strict") -> PatchHandle:
    """Patch ``model`` (a ``vllm_omni`` ``MiniMaxH3DiTModel``, the family served) onto flowlock's strict path.

    ``mode`` is ``"strict"`` (a module flowlock cannot compute raises ``StrictModeError`` naming
    it, before any op runs) or ``"audit"`` (that module runs its own forward and the fallback is
    recorded in ``handle.fallbacks`` or the caller's audit frame). Inside
    ``flowlock.mode("provider")`` the patched model runs vLLM-Omni's own forward. Serves every
    TP degree vLLM-Omni builds H3 with (TP > 1 gives TP = 1's bits: see
    :mod:`flowlock.integrations.vllm_omni.minimax_h3.tensor_parallel`; every TP rank must call install(),
    which agrees on the layout across the group), or Ulysses sequence parallelism alone
    (``ulysses_degree > 1``, vLLM-Omni's SP hooks applied or not: see
    :mod:`flowlock.integrations.vllm_omni.minimax_h3.sequence_parallel`); never ring (see
    :mod:`flowlock.integrations.vllm_omni.minimax_h3.coverage`).

    Raises TypeError for another model class, ValueError for another mode or a TP layout the
    strict path refuses (naming the reason), RuntimeError when the model is already patched.
    Returns the handle whose ``remove()`` restores each forward by identity.
    """
    return patch_registered(_ADAPTERS, model, mode, "install()")
