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
import types

from flowlock.models.minimax_h3.strict import strict_forward
from flowlock.modes import current_mode, fallback_or_raise, mode


def make_patched_forward(model, original, handle):
    """The replacement of ``model.forward``: a method bound to ``model``.

    Bound rather than a closure over ``model`` so that ``copy.deepcopy`` of a patched model (RL
    frameworks copy the policy to make a reference model) rebinds it to the copy, which then runs
    the strict path on its own weights. ``original`` is the forward read when the plan was built;
    when it is the class's own forward it is looked up on the class at call time, for the same
    reason.
    """
    signature = inspect.signature(type(model).forward)
    instance_forward = None if _is_class_forward(model, original) else original

    @functools.wraps(type(model).forward)
    def forward(self, *args, **kwargs):
        stock = instance_forward or type(self).forward.__get__(self)
        if current_mode() == "provider":
            return stock(*args, **kwargs)
        call = dict(signature.bind(self, *args, **kwargs).arguments)
        call.pop("self")
        if current_mode() == "audit" or handle.mode == "strict":
            return _strict(self, stock, args, kwargs, call)
        with mode("audit") as frame:
            out = _strict(self, stock, args, kwargs, call)
        handle.fallbacks.extend(frame.fallbacks)
        return out

    return types.MethodType(forward, model)


def _is_class_forward(model, method) -> bool:
    return getattr(method, "__self__", None) is model and getattr(method, "__func__", None) is type(model).forward


def _strict(model, stock, args, kwargs, call):
    attention_kwargs = call.pop("attention_kwargs", None)
    if attention_kwargs and attention_kwargs.get("scale", 1.0) != 1.0:
        # diffusers rescales every LoRA layer in place for the call; the strict path does not mutate weights.
        fallback_or_raise("minimax_h3 forward", "a LoRA scale in attention_kwargs is not on the strict path")
        return stock(*args, **kwargs)
    return strict_forward(model, **call)
