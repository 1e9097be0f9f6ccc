"""Reversible, plan-as-data patching of a model instance.

A plan is a list of :class:`PatchEntry` ``(module qualified name, attribute, replacement)``. Modules
are found by their exact qualified name (``root.get_submodule``) and, when the entry names one,
checked against their type: never by substring. Applying a plan records what each attribute held *on the
instance* (including a pre-existing instance-level ``forward``) and :meth:`PatchHandle.remove`
puts back exactly that, by identity, and verifies it. Only plain attributes are patched, never
parameters, buffers or submodules, so ``state_dict`` is untouched. A module can be patched by one
handle at a time. A replacement carries :data:`REPLACEMENT_MARK`, so a module holding one that no
handle owns (a ``copy.deepcopy`` of a patched model, which stays patched) is refused as well.

:func:`patch` is the public entry: it picks the plan registered for the model's class. Model families
register theirs with :func:`register_plan` by import path, so this module imports no model package
(and no model library) and a family's code is imported only when a model of it is patched.
"""

from __future__ import annotations

import importlib
import weakref
from dataclasses import dataclass, field

from torch import nn

from flowlock.modes import Fallback

_MISSING = object()

# Set (true) on every replacement function; read through a bound method's attribute lookup.
REPLACEMENT_MARK = "__flowlock_replacement__"

# Modules currently patched -> the handle that patched them.
_ACTIVE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _EagerPrecision:
    """Keeps inductor's ``emulate_precision_casts`` on while any handle is live, then restores it.

    Inductor computes a fused chain of bf16 / fp16 pointwise ops in fp32 and rounds once at the end,
    where eager rounds after every op. Flowlock's ops are opaque custom ops in a compiled graph, but
    what lies between them is plain PyTorch: residual adds, casts, and autograd's sums of the
    gradients of a tensor used more than once (q, k and v read one normalised x: eager rounds
    ``(dv + dk)`` before adding ``dq``). Seen on the tiny H3 on CPU: 47 of 63 gradients differed from
    eager without it, none with it. The flag rounds where eager does, so a patched model compiled
    with inductor keeps eager's bits; it affects only graphs inductor compiles while a patch is live.
    """

    live = 0
    previous: bool | None = None

    @classmethod
    def hold(cls) -> None:
        from torch._inductor import config

        if cls.live == 0:
            cls.previous = config.emulate_precision_casts
            config.emulate_precision_casts = True
        cls.live += 1

    @classmethod
    def release(cls) -> None:
        from torch._inductor import config

        cls.live -= 1
        if cls.live == 0:
            config.emulate_precision_casts = cls.previous

# (model class module, class qualified name) -> "package.module:function" building that class's plan.
_PLANS: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class PatchEntry:
    """Set ``attribute`` of the submodule named ``module`` ("" for the root) to ``replacement``.

    ``module_type``, when given, must be the submodule's type or a subclass of it (FSDP2's
    ``fully_shard`` swaps a module's class for a generated subclass).
    """

    module: str
    attribute: str
    replacement: object
    module_type: type | None = None


@dataclass
class _Applied:
    entry: PatchEntry
    target: nn.Module
    previous: object  # the instance-level value before patching, or _MISSING


@dataclass
class PatchHandle:
    """What one plan changed on one model; :meth:`remove` undoes it exactly.

    ``mode`` is the mode the patched code runs in; ``fallbacks`` collects the audit fallbacks it
    made when it ran in a mode frame of its own (see ``flowlock.models.common.patched_forward``).
    """

    mode: str
    fallbacks: list[Fallback] = field(default_factory=list)
    _applied: list[_Applied] = field(default_factory=list)
    _removed: bool = False

    @property
    def patched(self) -> list[tuple[str, str]]:
        """``(module qualified name, attribute)`` of every live patch ("" names the root)."""
        return [] if self._removed else [(a.entry.module, a.entry.attribute) for a in self._applied]

    @property
    def active(self) -> bool:
        return not self._removed

    def overwritten(self) -> list[tuple[str, str]]:
        """``(module qualified name, attribute)`` of every live patch whose attribute no longer holds
        flowlock's replacement (someone assigned over it after the patch)."""
        if self._removed:
            return []
        return [(a.entry.module, a.entry.attribute) for a in self._applied
                if a.target.__dict__.get(a.entry.attribute, _MISSING) is not a.entry.replacement]

    def remove(self) -> None:
        """Restore every patched attribute to its previous instance-level value (or its absence).

        Raises RuntimeError when called twice or when a patched attribute no longer holds the
        replacement (someone else changed it: restoring would silently drop their change).
        """
        if self._removed:
            raise RuntimeError("this patch was already removed")
        for applied in reversed(self._applied):
            current = applied.target.__dict__.get(applied.entry.attribute, _MISSING)
            if current is not applied.entry.replacement:
                raise RuntimeError(f"{_label(applied.entry)} no longer holds the flowlock replacement; "
                                   "refusing to restore over a foreign change")
        for applied in reversed(self._applied):
            _restore(applied)
        for applied in self._applied:
            if applied.target.__dict__.get(applied.entry.attribute, _MISSING) is not applied.previous:
                raise RuntimeError(f"{_label(applied.entry)} was not restored")
            _ACTIVE.pop(applied.target, None)
        self._removed = True
        _EagerPrecision.release()

    def __enter__(self) -> PatchHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def _label(entry: PatchEntry) -> str:
    return f"{entry.module or '<root>'}.{entry.attribute}"


def _restore(applied: _Applied) -> None:
    if applied.previous is _MISSING:
        del applied.target.__dict__[applied.entry.attribute]
    else:
        applied.target.__dict__[applied.entry.attribute] = applied.previous


def apply_plan(root: nn.Module, plan: list[PatchEntry], handle: PatchHandle) -> PatchHandle:
    """Apply every entry of ``plan`` to ``root``, record them in the fresh ``handle`` and return it.

    All entries are resolved and checked before anything changes, so a bad plan leaves the model
    untouched. Raises RuntimeError when a target module is already patched, AttributeError for an
    unknown qualified name, TypeError for a wrong module type or an entry that would touch a
    parameter, buffer or submodule.
    """
    resolved = []
    for entry in plan:
        target = root.get_submodule(entry.module)
        if entry.module_type is not None and not isinstance(target, entry.module_type):
            raise TypeError(f"{entry.module or '<root>'} is {type(target).__name__}, the plan expects "
                            f"{entry.module_type.__name__}")
        if target in _ACTIVE:
            raise RuntimeError(f"{entry.module or '<root>'} is already patched by flowlock; remove() that patch "
                               "first")
        if getattr(target.__dict__.get(entry.attribute), REPLACEMENT_MARK, False):
            raise RuntimeError(f"{_label(entry)} is already patched by flowlock through a copy of a patched model "
                               "(a deep copy keeps its patch for life; use flowlock.mode('provider') for stock)")
        name = entry.attribute
        if name in target._parameters or name in target._buffers or name in target._modules:
            raise TypeError(f"{_label(entry)} is a parameter, buffer or submodule; plans patch plain attributes")
        if isinstance(entry.replacement, (nn.Module, nn.Parameter)):
            raise TypeError(f"{_label(entry)}: a replacement must not be a module or parameter")
        resolved.append((entry, target))
    if handle._applied or handle._removed:
        raise RuntimeError("apply_plan needs a fresh PatchHandle")
    for entry, target in resolved:
        previous = target.__dict__.get(entry.attribute, _MISSING)
        target.__dict__[entry.attribute] = entry.replacement
        handle._applied.append(_Applied(entry, target, previous))
        _ACTIVE[target] = handle
    _EagerPrecision.hold()
    return handle


def active_patch(module: nn.Module) -> PatchHandle | None:
    """The live flowlock patch that replaced an attribute of ``module`` itself, or None."""
    return _ACTIVE.get(module)


def register_plan(model_class: str, builder: str) -> None:
    """Register the patch plan of a model class, both given by import path.

    ``model_class`` is ``"package.module.ClassName"``, ``builder`` is ``"package.module:function"``
    with ``function(model, handle) -> list[PatchEntry]``. Nothing is imported until :func:`patch`
    meets an instance of the class (or of a subclass, e.g. FSDP2's generated one).
    """
    module, _, name = model_class.rpartition(".")
    if not module or ":" not in builder:
        raise ValueError(f"register_plan wants 'package.module.Class' and 'package.module:function', "
                         f"got {model_class!r}, {builder!r}")
    _PLANS[(module, name)] = builder


def patch_registered(plans: dict[tuple[str, str], str], model: nn.Module, mode: str, entry: str) -> PatchHandle:
    """Apply the plan ``plans`` registers for ``model``'s class or its nearest registered base class
    (``(class module, class qualified name) -> "package.module:function"``, imported now) in ``mode``.

    Raises ValueError for a mode other than ``"strict"`` / ``"audit"``, TypeError naming ``entry`` (the
    public function refusing), the supported classes and ``model``'s class when none is registered.
    """
    if mode not in ("strict", "audit"):
        raise ValueError(f"mode must be 'strict' or 'audit', got {mode!r}")
    build_plan = _registered_builder(plans, model, entry)
    handle = PatchHandle(mode)
    return apply_plan(model, build_plan(model, handle), handle)


def _registered_builder(plans: dict[tuple[str, str], str], model: nn.Module, entry: str):
    for cls in type(model).__mro__:
        builder = plans.get((cls.__module__, cls.__qualname__))
        if builder is not None:
            module, _, function = builder.partition(":")
            return getattr(importlib.import_module(module), function)
    supported = ", ".join(sorted(name for _, name in plans)) or "none registered"
    raise TypeError(f"{entry} supports {supported}, got {type(model).__name__}")


def patch(model: nn.Module, mode: str = "strict") -> PatchHandle:
    """Route ``model``'s forward through flowlock's strict path; return the handle that undoes it.

    ``mode`` is ``"strict"`` (anything flowlock cannot serve raises ``StrictModeError``) or
    ``"audit"`` (such a step runs the stock module and is recorded). A caller's
    ``with flowlock.mode("audit"):`` also gives audit behaviour, and inside
    ``with flowlock.mode("provider"):`` the patched model runs its original forward. Parameters,
    buffers and the module tree are not touched. Supported: the classes whose family registered a
    plan (:mod:`flowlock.models`: diffusers' ``MiniMaxH3Transformer3DModel``).
    """
    return patch_registered(_PLANS, model, mode, "flowlock.patch")
