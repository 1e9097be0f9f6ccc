"""The patched H3 forward: strict path by default, the original forward in provider mode.

At call time: in ``flowlock.mode("provider")`` the original forward runs untouched (A/B against
the stock path). Otherwise the strict forward runs in audit mode when either the caller's mode or
the patch's mode is ``audit``, else in strict mode. When the caller's frame already has that mode
it receives the readback; a patch in audit mode called outside any audit frame pushes one for the
call and appends its fallbacks to ``PatchHandle.fallbacks``.
"""

from __future__ import annotations

import functools
import inspect

from flowlock.models.minimax_h3.strict import strict_forward
from flowlock.modes import current_mode, fallback_or_raise, mode


def make_patched_forward(model, original, handle):
    """A plain function (stored on the instance, so not bound) replacing ``model.forward``."""
    signature = inspect.signature(type(model).forward)

    @functools.wraps(type(model).forward)
    def forward(*args, **kwargs):
        if current_mode() == "provider":
            return original(*args, **kwargs)
        bound = signature.bind(model, *args, **kwargs)
        call = dict(bound.arguments)
        call.pop("self")
        if current_mode() == "audit" or handle.mode == "strict":
            return _strict(model, original, args, kwargs, call)
        with mode("audit") as frame:
            out = _strict(model, original, args, kwargs, call)
        handle.fallbacks.extend(frame.fallbacks)
        return out

    return forward


def _strict(model, original, args, kwargs, call):
    attention_kwargs = call.pop("attention_kwargs", None)
    if attention_kwargs and attention_kwargs.get("scale", 1.0) != 1.0:
        # diffusers rescales every LoRA layer in place for the call; the strict path does not mutate weights.
        fallback_or_raise("minimax_h3 forward", "a LoRA scale in attention_kwargs is not on the strict path")
        return original(*args, **kwargs)
    return strict_forward(model, **call)
