"""The run context of a strict forward: one forward's decisions, handed from the root to every
patched submodule it calls, also when autograd recomputes a checkpointed call.

A strict root forward decides once, before any op runs, which modules it cannot serve (strict mode
raises, audit mode records the fallback and lets the module run its own forward). It then calls
its submodules through ``__call__`` (their hooks run, FSDP2 unshards there) with
:func:`call_with_run`, which makes those decisions the *active run* of the thread for the call; a
patched submodule's forward takes the active run, or makes its own when called alone. Every engine's
strict path uses this one context, so the diffusers trainer and the vLLM-Omni rollout decide the
same way.
"""

from __future__ import annotations

import threading

from torch import nn

from flowlock.modes import fallback_or_raise

# Set on the functions a patch installs as forwards of the modules a strict root forward calls.
STRICT_MARK = "__flowlock_strict__"

_ACTIVE = threading.local()


def active_run():
    """The decisions of the strict root forward currently calling a submodule on this thread, if any."""
    return getattr(_ACTIVE, "run", None)


def kept_slot():
    """The slot :func:`call_with_run` was given for this call (``kept``), or None."""
    return getattr(_ACTIVE, "kept", None)


def is_strict(module: nn.Module) -> bool:
    """Whether ``module.forward`` is a strict forward a flowlock patch installed."""
    return getattr(module.forward, STRICT_MARK, False)


def call_with_run(run, module: nn.Module, *args, kept=None, **kwargs):
    """Call the patched ``module`` through ``__call__`` (its hooks run: FSDP2 unshards a unit's
    parameters there) with ``run`` as the active
    decisions and ``kept`` as the call's slot (a value its forward keeps for its recomputation, e.g.
    a checkpointed block's AdaLN table; None otherwise). Both are restored after, also on error.

    Raises RuntimeError when ``module.forward`` is not a strict forward (the model is not patched).
    """
    if not is_strict(module):
        raise RuntimeError(f"{type(module).__name__}.forward is not flowlock's: patch the model first "
                           "(flowlock.patch for diffusers, flowlock.integrations.vllm_omni.install for vLLM-Omni), "
                           "which routes the blocks and other submodules too")
    previous, previous_kept = active_run(), kept_slot()
    _ACTIVE.run, _ACTIVE.kept = run, kept
    try:
        return module(*args, **kwargs)
    finally:
        _ACTIVE.run, _ACTIVE.kept = previous, previous_kept


class RunDecisions:
    """One forward's decisions: which modules run their own forward (audit fallbacks; strict mode
    raised instead), and whether ops must range-check their indices (a submodule called on its own)
    or the root forward validated them already.

    ``scope`` prefixes the op name of every fallback (``"<scope> <module name>"``); ``root_name``
    names the root module in it.
    """

    scope = ""
    root_name = ""

    def __init__(self, check_indices: bool, root: nn.Module):
        self.fallback: set[int] = set()
        self.check_indices = check_indices
        self._root = root
        self._names: dict[int, str] | None = None

    def name(self, module: nn.Module) -> str:
        """``module``'s name under the root, for messages."""
        if self._names is None:
            # module names only for messages: walked once, and only when a message needs one, so a
            # passing forward of a deep model does not pay for named_modules()
            self._names = {id(m): n for n, m in self._root.named_modules()}
        return self._names.get(id(module), type(module).__name__)

    def _check(self, module: nn.Module, reason: str | None, fallback: nn.Module | None = None) -> None:
        if reason is None:
            return
        fallback_or_raise(f"{self.scope} {self.name(module) or self.root_name}", reason)
        self.fallback.add(id(fallback if fallback is not None else module))

    def runs_own(self, module: nn.Module) -> bool:
        # An empty set (always so in strict mode) answers without id(module): torch.compile guards on
        # the id of what it hashes, which would compile each block instance as a graph of its own.
        return bool(self.fallback) and id(module) in self.fallback
