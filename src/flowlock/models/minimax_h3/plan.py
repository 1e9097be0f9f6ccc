"""The patch plan for one ``MiniMaxH3Transformer3DModel`` instance, as data.

One entry: the instance's ``forward`` becomes the mode-aware strict forward of
:mod:`flowlock.models.minimax_h3.patch`. Nothing else changes: parameters, buffers, the FP32
modules and the module tree stay as they are, so ``state_dict`` is identical while patched.
"""

from __future__ import annotations

from diffusers import MiniMaxH3Transformer3DModel

from flowlock.models.minimax_h3.patch import make_patched_forward
from flowlock.patching import PatchEntry, PatchHandle


def build_plan(model: MiniMaxH3Transformer3DModel, handle: PatchHandle) -> list[PatchEntry]:
    """The entries that route ``model`` through the strict path under ``handle.mode``.

    The original forward is read now, so a pre-existing instance-level ``forward`` (another
    wrapper) is what provider mode calls and what ``remove()`` restores.
    """
    original = model.forward
    return [PatchEntry("", "forward", make_patched_forward(model, original, handle), type(model))]
