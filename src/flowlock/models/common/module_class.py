"""The class a strict path dispatches on, seen through FSDP2's wrapping."""

from __future__ import annotations


def module_class(module: object) -> type:
    """The module's own class. FSDP2's ``fully_shard`` swaps in a generated subclass
    ``(FSDPModule, cls)`` that adds sharding hooks, not arithmetic, so it counts as ``cls``."""
    from torch.distributed.fsdp import FSDPModule

    cls = type(module)
    if len(cls.__bases__) == 2 and cls.__bases__[0] is FSDPModule:
        return cls.__bases__[1]
    return cls
