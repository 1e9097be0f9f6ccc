"""Strict LoRA: a peft LoRA ``Linear`` computed with flowlock ``linear`` only.

peft's vanilla LoRA forward is ``base(x) + B(A(dropout(x.to(A.dtype)))) * scaling`` per active
adapter, then a cast back to the base output dtype. Here the three GEMMs are flowlock ``linear``
(row-pure, fixed K order) and the scale, add and cast are the same eager elementwise ops, so the
result is batch-invariant and repeatable. Dropout must be the identity; LoRA variants (DoRA and
others), a bias on the A factor and a layer whose adapters are disabled while merged are not served;
peft's ``lora_bias`` (a bias on B, added before the scaling as peft does) is.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from flowlock.models.common.diffusers_hooks import casts_lora_input, compute_param, leaf_hook_reason
from flowlock.models.common.module_class import module_class
from flowlock.ops.linear import linear

_LORA_ATTRS = ("base_layer", "lora_A", "lora_B", "scaling", "active_adapters", "merged")


def is_peft_lora(module: nn.Module) -> bool:
    """True for a peft LoRA layer (duck-typed on the attributes the strict path reads)."""
    return all(hasattr(module, a) for a in _LORA_ATTRS)


def _active(module: nn.Module) -> list[str]:
    return [a for a in module.active_adapters if a in module.lora_A]


def lora_unsupported_reason(module: nn.Module) -> str | None:
    """Why the strict path cannot compute this LoRA layer, or None when it can."""
    if module_class(module.base_layer) is not nn.Linear:
        return f"LoRA base layer {type(module.base_layer).__name__} is not torch.nn.Linear"
    if leaf_hook_reason(module.base_layer):
        return leaf_hook_reason(module.base_layer)
    if getattr(module, "disable_adapters", False):
        # peft unmerges a merged layer inside forward here: a weight mutation the strict path won't make.
        return "adapters disabled" if module.merged else None
    if module.merged:
        return None
    for name in _active(module):
        if name in getattr(module, "lora_variant", {}):
            return f"adapter {name!r} is a LoRA variant ({type(module.lora_variant[name]).__name__})"
        dropout = module.lora_dropout[name]
        if not (isinstance(dropout, nn.Identity) or (isinstance(dropout, nn.Dropout)
                                                     and (dropout.p == 0.0 or not dropout.training))):
            return f"adapter {name!r} has active dropout (strict LoRA needs the identity)"
        a, b = module.lora_A[name], module.lora_B[name]
        if module_class(a) is not nn.Linear or module_class(b) is not nn.Linear or a.bias is not None:
            return f"adapter {name!r} has factors of another type than torch.nn.Linear or a bias on A"
        for part in (a, b):
            if leaf_hook_reason(part):
                return leaf_hook_reason(part)
    return None


def strict_lora_linear(module: nn.Module, x: torch.Tensor, gemm: Callable[..., torch.Tensor] = linear
                       ) -> torch.Tensor:
    """The peft LoRA ``Linear`` forward on flowlock ``linear``: ``(..., K) -> (..., N)``.

    ``gemm(x, weight, bias=None)`` computes each of the three GEMMs (default flowlock ``linear``; the
    exact Ulysses path passes its all-rows weight-gradient wrapper). Call only when
    :func:`lora_unsupported_reason` returned None.
    """
    base = module.base_layer
    result = gemm(x, compute_param(base, "weight"), compute_param(base, "bias"))
    if module.merged or getattr(module, "disable_adapters", False):
        return result
    out_dtype = result.dtype
    for name in _active(module):
        a, b = module.lora_A[name], module.lora_B[name]
        a_weight = compute_param(a, "weight")
        if casts_lora_input(module):
            x = x.to(a_weight.dtype)
        delta = gemm(gemm(x, a_weight), compute_param(b, "weight"), compute_param(b, "bias"))
        result = result + delta * module.scaling[name]
    return result.to(out_dtype)
