"""The patched forward every strict path installs: the strict forward by default, the original in
provider mode, in the mode the caller or the patch asks for.

At call time: in ``flowlock.mode("provider")`` the original forward runs untouched (A/B against
the stock path). Otherwise the strict forward runs in audit mode when either the caller's mode or
the patch's mode is ``audit``, else in strict mode. When the caller's frame already has that mode
it receives the readback; a patch in audit mode called outside any audit frame pushes one for the
call and appends its fallbacks to ``PatchHandle.fallbacks``.

Modes and a forced backend are thread-local, and on CUDA the autograd engine recomputes a
gradient-checkpointed block on its own threads, where neither is set: a provider-mode forward would
be recomputed on the strict path (other activations, silently other gradients), an audit-mode one
in strict mode. While a patched module that owns diffusers' ``_gradient_checkpointing_func`` runs
eagerly, the function is wrapped so that each checkpointed call records the caller's mode and
backend and its recomputation runs in them (:class:`_InCallerState`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types

import torch

from flowlock.dispatch import forced_backend, use_backend
from flowlock.models.common.run_context import STRICT_MARK
from flowlock.modes import current_mode, mode
from flowlock.patching import REPLACEMENT_MARK

__all__ = ["make_patched_forward"]


def make_patched_forward(module, original, handle, strict_call):
    """The replacement of ``module.forward``: a method bound to ``module``.

    ``strict_call(self, arguments, stock)`` computes the strict output from the bound arguments
    (a name -> value dict) or returns ``stock``'s. Bound rather than a closure over ``module`` so
    that ``copy.deepcopy`` of a patched model (RL frameworks copy the policy to make a reference
    model) rebinds it to the copy, which then runs the strict path on its own weights (in this
    handle's mode; no handle owns the copy's patch, so it keeps it and ``flowlock.patch`` refuses it).
    ``original`` is the forward read when the plan was built; when it is the class's own forward it
    is looked up on the class at call time, for the same reason.
    """
    cls_forward = type(module).forward
    signature = inspect.signature(cls_forward)
    instance_forward = None if _is_class_forward(module, original) else original

    @functools.wraps(cls_forward)
    def forward(self, *args, **kwargs):
        if _checkpoints(self):
            with _checkpoints_in_caller_state(self):
                return _forward(self, *args, **kwargs)
        return _forward(self, *args, **kwargs)

    def _forward(self, *args, **kwargs):
        # A partial, not type(self).forward.__get__(self): torch 2.11's dynamo cannot trace __get__.
        stock = instance_forward or functools.partial(type(self).forward, self)
        if current_mode() == "provider":
            return stock(*args, **kwargs)
        arguments = dict(signature.bind(self, *args, **kwargs).arguments)
        arguments.pop("self")
        call = functools.partial(strict_call, self, arguments, functools.partial(stock, *args, **kwargs))
        if current_mode() == "audit" or handle.mode == "strict":
            return call()
        with mode("audit") as frame:
            out = call()
        handle.fallbacks.extend(frame.fallbacks)
        return out

    setattr(forward, STRICT_MARK, True)
    setattr(forward, REPLACEMENT_MARK, True)
    return types.MethodType(forward, module)


class _InCallerState:
    """``module`` called in the mode and forced backend that were active when this was made, on
    whichever thread calls it (diffusers' checkpoint function calls ``module.__call__``)."""

    def __init__(self, module):
        self.module, self.mode, self.backend = module, current_mode(), forced_backend()

    def __call__(self, *args, **kwargs):
        if current_mode() == self.mode and forced_backend() == self.backend:
            # the checkpointed forward itself, on the caller's thread: its ops report to the caller's frame
            return self.module(*args, **kwargs)
        with mode(self.mode), (use_backend(self.backend) if self.backend else contextlib.nullcontext()):
            return self.module(*args, **kwargs)


def _checkpoints(module) -> bool:
    """Whether ``module`` owns diffusers' checkpoint function and has checkpointing on."""
    return "_gradient_checkpointing_func" in module.__dict__ and getattr(module, "gradient_checkpointing", False)


def _in_caller_state(checkpoint):
    def checkpointed(block, *args, **kwargs):
        return checkpoint(_InCallerState(block), *args, **kwargs)
    return checkpointed


@contextlib.contextmanager
def _checkpoints_in_caller_state(root):
    """For the call: every module under ``root`` that checkpoints (the model, its token refiner) wraps
    its checkpoint function with :class:`_InCallerState`; restored after, also on error."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        yield
        return
    owners = [m for m in root.modules() if _checkpoints(m)]
    originals = [m._gradient_checkpointing_func for m in owners]
    for m, checkpoint in zip(owners, originals):
        m._gradient_checkpointing_func = _in_caller_state(checkpoint)
    try:
        yield
    finally:
        for m, checkpoint in zip(owners, originals):
            m._gradient_checkpointing_func = checkpoint


def _is_class_forward(module, method) -> bool:
    return getattr(method, "__self__", None) is module and getattr(method, "__func__", None) is type(module).forward
