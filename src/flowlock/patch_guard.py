"""What a patch plan was built for, and the cheap call-time test that nothing has changed since.

A family's plan builder records, with :func:`record`, the dtype of every parameter and buffer the
strict path reads, by qualified name. At call time :meth:`PlanGuard.unchanged` answers whether the
model's tensors still have the dtypes and devices of the last state the family accepted for a call
on that device: one walk of the modules' registration dicts (:func:`flowlock.cuda_graphs.registered_tensors`,
the graphed path's storage check) and one list comparison, no names built. Only when it says no does
the family walk the model by name, compare with :attr:`PlanGuard.planned` and either raise or
:meth:`PlanGuard.accept` the new state (a model moved to the call's device, adapters added, storage
that a casting hook upcasts to the planned dtype). Host-only: nothing here reads a device value.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from flowlock.cuda_graphs import registered_tensors
from flowlock.patching import REPLACEMENT_MARK

# model -> its PlanGuard; weak, so a guard never keeps a model alive.
_GUARDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class PlanGuard:
    """``planned``: qualified tensor name -> the dtype the strict path was planned to compute with."""

    def __init__(self, planned: dict[str, torch.dtype]):
        self.planned = planned
        self._accepted: tuple | None = None

    @staticmethod
    def _signature(model: nn.Module, device: torch.device) -> tuple:
        return device, [(t.dtype, t.device) for t in registered_tensors((model,))]

    def unchanged(self, model: nn.Module, device: torch.device) -> bool:
        """Whether ``model``'s tensors are in the state last accepted for a call on ``device``."""
        return self._accepted is not None and self._signature(model, device) == self._accepted

    def accept(self, model: nn.Module, device: torch.device) -> None:
        """Remember the current state as checked for calls on ``device``."""
        self._accepted = self._signature(model, device)


def record(model: nn.Module, planned: dict[str, torch.dtype]) -> None:
    """Record what the plan being built for ``model`` expects. A model whose forward is already
    flowlock's keeps its record: ``apply_plan`` will refuse this second patch, and overwriting the
    live patch's record with today's dtypes would accept a cast made since."""
    if not getattr(model.__dict__.get("forward"), REPLACEMENT_MARK, False):
        _GUARDS[model] = PlanGuard(planned)


def guard_of(model: nn.Module) -> PlanGuard | None:
    """The record of ``model``'s patch; None for a model patched as a ``copy.deepcopy`` of a patched one."""
    return _GUARDS.get(model)


def adopt(model: nn.Module, planned: dict[str, torch.dtype]) -> PlanGuard:
    """Record ``planned`` for a model that has no record (a deep copy, patched by no handle)."""
    guard = _GUARDS[model] = PlanGuard(planned)
    return guard
