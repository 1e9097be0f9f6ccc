"""diffusers and accelerate hooks as a strict diffusers path sees them.

The strict path calls the modules ``flowlock.patch`` replaces (blocks, ``norm_out``, the input /
output linears, ...) through ``__call__``, so a hook registered on one of them *after* patching wraps
the strict forward and runs as in diffusers: block-level group offloading onloads a block before
its strict forward, model CPU offload moves the model, layerwise casting casts a patched linear.
A hook registered *before* patching wraps the forward that patching would replace; dropping it
would read offloaded or storage-dtype weights, so :func:`target_hooks` names it and patching refuses.

Inside those modules the strict path reads the leaf modules' parameters (``to_q``, ``norm1``, ...)
without calling them, so a leaf's pre-forward hook never runs. Served on a leaf:

* diffusers layerwise casting (``enable_layerwise_casting``): :func:`compute_param` returns
  ``param.to(compute_dtype)``, the bits the hook's pre-forward makes, as a new tensor (the module is
  not cast in place, so a saved weight is still the compute weight when backward reads it);
* diffusers' PEFT input-autocast-disable hook: the strict LoRA leaves the input's dtype alone, as
  the hook does.

Any other hook on a leaf (leaf-level group offloading, accelerate's offload hooks, ...) is refused
by :func:`leaf_hook_reason`: its weights may be offloaded, on ``meta`` or not what compute uses.
"""

from __future__ import annotations

import torch
from torch import nn

LAYERWISE_CASTING = "layerwise_casting"
PEFT_AUTOCAST_DISABLE = "peft_autocast_disable"
_SERVED_ON_LEAVES = (LAYERWISE_CASTING, PEFT_AUTOCAST_DISABLE)
# Name prefixes of the hooks diffusers' enable_parallelism registers from the model's _cp_plan.
_CONTEXT_PARALLEL_HOOKS = ("cp_input---", "cp_output---")


def _diffusers_hooks(module: nn.Module) -> dict:
    registry = getattr(module, "_diffusers_hook", None)
    return registry.hooks if registry is not None else {}


def hook_names(module: nn.Module) -> list[str]:
    """The diffusers hook names on ``module`` and, for an accelerate hook, its class name."""
    names = list(_diffusers_hooks(module))
    accelerate_hook = getattr(module, "_hf_hook", None)
    if accelerate_hook is not None:
        names.append(f"accelerate {type(accelerate_hook).__name__}")
    return names


def _unserved_hooks(module: nn.Module) -> list[str]:
    # diffusers' context-parallel split / gather hooks (enable_parallelism) are served everywhere:
    # a strict forward makes the same cut itself (H3's: flowlock.models.minimax_h3.context_parallel).
    return [name for name in hook_names(module) if not name.startswith(_CONTEXT_PARALLEL_HOOKS)]


def target_hooks(module: nn.Module) -> list[str]:
    """Hooks that wrap ``module.forward`` now; a module flowlock is about to patch must have none
    (diffusers' context-parallel split / gather hooks are not counted: the strict forward does their cut)."""
    return _unserved_hooks(module)


def leaf_hook_reason(module: nn.Module) -> str | None:
    """Why the strict path cannot read ``module``'s parameters without calling it, or None."""
    refused = [name for name in _unserved_hooks(module) if name not in _SERVED_ON_LEAVES]
    if not refused:
        return None
    return (f"hook {', '.join(refused)} prepares this module's weights in its forward, which the strict path "
            "does not call (supported: diffusers layerwise casting, block-level group offloading, model CPU "
            "offload)")


def compute_param(module: nn.Module, name: str) -> torch.Tensor | None:
    """``module.<name>`` as the module's forward would compute with it (see the module docstring)."""
    param = getattr(module, name)
    hook = _diffusers_hooks(module).get(LAYERWISE_CASTING)
    if param is None or hook is None or param.dtype == hook.compute_dtype:
        return param
    return param.to(hook.compute_dtype)


def compute_dtype(module: nn.Module, t: torch.Tensor) -> torch.dtype:
    """The dtype :func:`compute_param` gives ``t``, a tensor registered on ``module``, without casting it."""
    hook = _diffusers_hooks(module).get(LAYERWISE_CASTING)
    return hook.compute_dtype if hook is not None and t.is_floating_point() else t.dtype


def casts_lora_input(module: nn.Module) -> bool:
    """Whether peft casts a LoRA layer's input to the adapter dtype: not when the layer's
    ``cast_input_dtype_enabled`` is off or diffusers' autocast-disable hook turns it off in forward."""
    return getattr(module, "cast_input_dtype_enabled", True) and PEFT_AUTOCAST_DISABLE not in _diffusers_hooks(module)
