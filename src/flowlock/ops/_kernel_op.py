"""Opaque ``flowlock::<name>`` operators for the Triton launchers, defined at the dispatcher level.

Under torch.compile every flowlock kernel is one opaque node (inductor may not rewrite its
arithmetic), and the compiled code calls that operator once per launch. ``torch.library.custom_op``
would serve, but each call then runs its Python layers: an autograd kernel that redispatches, and a
backend wrapper that checks the outputs for aliasing. That was the host time of the compiled strict
step at S = 925 on the H200 (cProfile: 2684 op calls spent 660 ms in the backend wrapper alone,
against 270 ms of launching; ``benchmarks/results/model_h200_100b481_S925_host.json``), and about
40 us against 4 us per call of a plain ``Library`` operator on a CPU host. :func:`kernel_op`
registers the launcher itself as the operator's kernel (``CompositeExplicitAutograd``: every
device, no autograd formula) and its fake for tracing, so a call is the dispatcher and the
launcher, nothing else.

Contract of a kernel registered here (every flowlock launcher keeps it): its outputs are new tensors
that alias no input and no other output, and it mutates nothing. No autograd formula is
registered: the autograd ``Function`` of each op family calls the forward and backward operators
with gradients off.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_LIBRARY = torch.library.Library("flowlock", "FRAGMENT")


class KernelOp:
    """The operator ``flowlock::<name>``: call it like the launcher it wraps; ``register_fake`` (a
    decorator) gives it the shapes-only implementation that tracing runs."""

    __slots__ = ("qualname", "op")

    def __init__(self, name: str, kernel: Callable):
        self.qualname = f"flowlock::{name}"
        _LIBRARY.define(name + torch.library.infer_schema(kernel, mutates_args=()))
        _LIBRARY.impl(name, kernel, "CompositeExplicitAutograd")
        self.op = getattr(torch.ops.flowlock, name).default

    def __call__(self, *args, **kwargs):
        return self.op(*args, **kwargs)

    def register_fake(self, fake: Callable) -> Callable:
        torch.library.register_fake(self.qualname, fake, lib=_LIBRARY)
        return fake


def kernel_op(qualname: str, kernel: Callable | None = None):
    """``kernel_op("flowlock::name", fn)`` or ``@kernel_op("flowlock::name")``: the :class:`KernelOp`
    of ``fn``, whose schema is read from its annotations."""
    namespace, _, name = qualname.partition("::")
    if namespace != "flowlock" or not name:
        raise ValueError(f"kernel ops live in the flowlock namespace, got {qualname!r}")
    if kernel is None:
        return lambda fn: KernelOp(name, fn)
    return KernelOp(name, kernel)
