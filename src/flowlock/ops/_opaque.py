"""The reference backend as opaque custom ops, so torch.compile cannot rewrite its arithmetic.

Eager code runs a family's ``<op>_reference`` directly and autograd differentiates through it.
Traced by torch.compile, the same PyTorch ops would be handed to inductor, which fuses and
reorders them (bf16 intermediates kept in fp32, its own sin / cos / exp, FMA contraction): other
bits. :func:`opaque_reference` registers the spec as one custom op ``flowlock::<name>`` whose
backward is a second one, ``flowlock::<name>_bwd``, that recomputes the spec with autograd on and
differentiates it exactly as eager autograd does (the same backward ops in the same order, so the
same bits). Graphs then hold two opaque nodes per call; the price is one extra forward of the op
in the compiled backward, paid only on the CPU reference backend.

Each family's ``opaque.py`` declares its ops here; its ``api.py`` calls the op while tracing
(:func:`flowlock.ops._triton_utils.traced`) and the spec itself otherwise, as the Triton
launchers do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._C import DispatchKey

# What a custom op's kernel sees excluded from dispatch (the op's autograd layer has run already);
# the backward kernel puts them back to record the spec's graph.
_AUTOGRAD_KEYS = (DispatchKey.AutogradFunctionality, DispatchKey.AutogradOther, DispatchKey.AutogradNestedTensor,
                  DispatchKey.ADInplaceOrView)


class _TensorList:
    """Placeholder for a ``Tensor[]`` argument of ``n`` tensors in a saved argument template."""

    def __init__(self, n: int):
        self.n = n


_TENSOR = object()  # placeholder for one Tensor argument


def _split(args: Sequence[Any]) -> tuple[list[Any], list[torch.Tensor]]:
    """``args`` as a template (tensors replaced by placeholders) and their tensors in order."""
    template, tensors = [], []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            template.append(_TENSOR)
            tensors.append(arg)
        elif isinstance(arg, (list, tuple)):
            template.append(_TensorList(len(arg)))
            tensors.extend(arg)
        else:
            template.append(arg)
    return template, tensors


def _join(template: Sequence[Any], tensors: Sequence[torch.Tensor]) -> list[Any]:
    """Inverse of :func:`_split`."""
    it = iter(tensors)
    return [next(it) if a is _TENSOR else [next(it) for _ in range(a.n)] if isinstance(a, _TensorList) else a
            for a in template]


def _flat_needs(args: Sequence[Any], needs: Sequence[Any]) -> list[bool]:
    """One flag per tensor of ``args`` (in :func:`_split` order) from autograd's per-argument
    ``needs_input_grad`` (a list of flags for a ``Tensor[]`` argument)."""
    flat = []
    for arg, need in zip(args, needs):
        if isinstance(arg, torch.Tensor):
            flat.append(bool(need))
        elif isinstance(arg, (list, tuple)):
            flat.extend(bool(n) for n in need)
    return flat


def _own(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``outputs`` contiguous (the fakes' layout, which inductor plans around) and sharing no storage
    with ``inputs`` or with one another (a custom op may not return an alias): copies where needed,
    which move no bits."""
    seen = {t.untyped_storage().data_ptr() for t in inputs if t.numel()}
    owned = []
    for t in outputs:
        t = t.contiguous()
        if t.numel():
            if t.untyped_storage().data_ptr() in seen:
                t = t.clone()
            seen.add(t.untyped_storage().data_ptr())
        owned.append(t)
    return owned


def _autograd_on():
    """Record autograd graphs inside a custom op kernel (which runs below the autograd keys)."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in _AUTOGRAD_KEYS:
        exclude = exclude.remove(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


def reference_grads(spec: Callable, args: Sequence[Any], needs: Sequence[bool],
                    cotangents: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Gradients of ``spec(*args)`` for the output ``cotangents`` (one per output, in order), with
    respect to the tensors of ``args`` flagged in ``needs`` (one flag per tensor, :func:`_split`
    order): autograd through the spec itself, so eager's backward bits. An input the outputs do not
    depend on gets zeros."""
    template, tensors = _split(args)
    with _autograd_on(), torch.enable_grad():
        leaves = [t.detach().requires_grad_() if need else t for t, need in zip(tensors, needs)]
        outputs = spec(*_join(template, leaves))
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, c) for o, c in zip(outputs, cotangents) if o.requires_grad]
        wrt = [leaf for leaf, need in zip(leaves, needs) if need]
        grads = torch.autograd.grad([o for o, _ in pairs], wrt, [c for _, c in pairs], allow_unused=True)
    grads = [torch.zeros_like(leaf) if g is None else g for g, leaf in zip(grads, wrt)]
    return _own(grads, [*tensors, *cotangents])


def opaque_reference(name: str, spec: Callable, args: str, returns: str, fake: Callable):
    """Register ``spec`` as the custom op ``flowlock::<name>`` (schema ``args -> returns``, e.g.
    ``"(Tensor x, float eps)"`` and ``"Tensor"``; ``fake`` gives its outputs' shapes, contiguous)
    with a backward ``flowlock::<name>_bwd`` of :func:`reference_grads`. Returns the op.

    The op's outputs are the spec's bits, as contiguous tensors of their own; its gradients are
    eager autograd's bits through the spec (only for inputs that need one).
    """
    def forward(*inputs):
        outputs = spec(*inputs)
        owned = _own(outputs if isinstance(outputs, tuple) else (outputs,), _split(inputs)[1])
        return tuple(owned) if isinstance(outputs, tuple) else owned[0]

    op = torch.library.custom_op(f"flowlock::{name}", forward, mutates_args=(), schema=f"{args} -> {returns}")
    op.register_fake(fake)

    def backward_kernel(cotangents, *rest):
        return reference_grads(spec, rest[:-1], rest[-1], cotangents)

    def backward_fake(cotangents, *rest):
        _, tensors = _split(rest[:-1])
        return [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t, need in zip(tensors, rest[-1]) if need]

    inner = args.strip()[1:-1]
    bwd = torch.library.custom_op(f"flowlock::{name}_bwd", backward_kernel, mutates_args=(),
                                  schema=f"(Tensor[] cotangents, {inner}, bool[] needs) -> Tensor[]")
    bwd.register_fake(backward_fake)

    def setup_context(ctx, inputs, output):
        ctx.template, tensors = _split(inputs)
        ctx.save_for_backward(*tensors)

    def backward(ctx, *cotangents):
        inputs = _join(ctx.template, ctx.saved_tensors)
        needs = _flat_needs(inputs, ctx.needs_input_grad)
        grads = iter(bwd(list(cotangents), *inputs, needs))
        flags = iter(needs)
        out = []
        for arg in inputs:
            if isinstance(arg, torch.Tensor):
                out.append(next(grads) if next(flags) else None)
            elif isinstance(arg, list):
                out.append([next(grads) if next(flags) else None for _ in arg])
            else:
                out.append(None)
        return tuple(out)

    op.register_autograd(backward, setup_context=setup_context)
    return op
