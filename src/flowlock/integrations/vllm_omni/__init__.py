"""flowlock inside vLLM-Omni: the strict forward of its native MiniMax-H3 DiT.

``handle = install(model)`` routes a ``MiniMaxH3DiTModel`` (vllm-omni 0.30.0) through flowlock's
ops, so a rollout computes the bits the diffusers trainer computes under ``flowlock.patch``;
``handle.remove()`` puts every original forward back. vLLM and vLLM-Omni are imported only when
:func:`install` runs.
"""

from __future__ import annotations

from flowlock.patching import PatchHandle, apply_plan

__all__ = ["install"]


def install(model, mode: str = "strict") -> PatchHandle:
    """Patch ``model`` (a ``vllm_omni`` ``MiniMaxH3DiTModel``) onto flowlock's strict path.

    ``mode`` is ``"strict"`` (a module flowlock cannot compute raises ``StrictModeError`` naming
    it, before any op runs) or ``"audit"`` (that module runs its own forward and the fallback is
    recorded in ``handle.fallbacks`` or the caller's audit frame). Inside
    ``flowlock.mode("provider")`` the patched model runs vLLM-Omni's own forward. Serves every
    TP degree vLLM-Omni builds H3 with (TP > 1 gives TP = 1's bits: see
    :mod:`flowlock.integrations.vllm_omni.tensor_parallel`; every TP rank must call install(),
    which agrees on the layout across the group), or Ulysses sequence parallelism alone
    (``ulysses_degree > 1``, vLLM-Omni's SP hooks applied or not: see
    :mod:`flowlock.integrations.vllm_omni.sequence_parallel`); never ring (see
    :mod:`flowlock.integrations.vllm_omni.coverage`).

    Raises TypeError for another model class, ValueError for another mode or a TP layout the
    strict path refuses (naming the reason), RuntimeError when the model is already patched.
    Returns the handle whose ``remove()`` restores each forward by identity.
    """
    if mode not in ("strict", "audit"):
        raise ValueError(f"mode must be 'strict' or 'audit', got {mode!r}")
    from vllm_omni.diffusion.models.minimax_h3.minimax_h3_transformer import MiniMaxH3DiTModel

    if not isinstance(model, MiniMaxH3DiTModel):
        raise TypeError(f"install() supports vLLM-Omni's MiniMaxH3DiTModel, got {type(model).__name__}")
    from flowlock.integrations.vllm_omni.plan import build_plan
    from flowlock.integrations.vllm_omni.sequence_parallel import NativeUlysses
    from flowlock.integrations.vllm_omni.tensor_parallel import NativeTensorParallel

    handle = PatchHandle(mode)
    sequence_parallel = NativeUlysses.for_model(model)
    tensor_parallel = NativeTensorParallel.for_model(model)
    return apply_plan(model, build_plan(model, handle, tensor_parallel, sequence_parallel), handle)
