"""Backend choice for flowlock ops.

An op runs on ``"triton"`` when its tensors live on a CUDA device and on ``"reference"`` (the
PyTorch spec) elsewhere. Tests force ``"triton"`` on CPU tensors with :func:`use_backend`, which
requires the Triton interpreter (``TRITON_INTERPRET=1`` set before Triton is imported). The choice
is explicit: nothing here falls back from one backend to the other.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager

import torch

from flowlock.modes import record_run

BACKENDS = ("triton", "reference")


class _Local(threading.local):
    forced: str | None = None


_local = _Local()

def interpreter_active() -> bool:
    """True when Triton kernels run under the CPU interpreter (``TRITON_INTERPRET=1`` in os.environ)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@contextmanager
def use_backend(name: str):
    """Force every flowlock op inside the block onto ``name`` (``"triton"`` or ``"reference"``)."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    previous = _local.forced
    _local.forced = name
    try:
        yield
    finally:
        _local.forced = previous


def forced_backend() -> str | None:
    """The backend :func:`use_backend` forces on this thread, or None."""
    return _local.forced


def backend_for(op: str, *tensors: torch.Tensor | None) -> str:
    """Resolve the backend for ``op`` from its tensors' device and record it in the mode readback.

    Raises ``ValueError`` when the tensors live on different devices and ``RuntimeError`` when
    ``"triton"`` is forced on CPU tensors without the interpreter.
    """
    device = None
    for t in tensors:
        if t is not None:
            if device is None:
                device = t.device
            elif t.device != device:
                devices = sorted({str(x.device) for x in tensors if x is not None})
                raise ValueError(f"{op}: all tensors must be on one device, got {devices}")
    if device is None:
        raise ValueError(f"{op}: all tensors must be on one device, got []")
    backend = _local.forced
    if backend is None:
        backend = "triton" if device.type == "cuda" else "reference"
    if backend == "triton" and device.type != "cuda" and not interpreter_active():
        raise RuntimeError(f"{op}: the triton backend on {device} needs TRITON_INTERPRET=1")
    record_run(op, backend)
    return backend
