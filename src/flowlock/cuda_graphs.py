"""CUDA graphs of a fixed-layout call: captured once, replayed with new input values.

At short sequences a training step costs more host time than GPU time: the strict full-depth H3
step at S = 925 makes about 3,400 launches of 20-35 us of host work each, and the GPU waits between
short kernels (``docs/performance.md``). A call whose layout is fixed (shapes, index tensors, the
storage of its weights) launches the same kernels on the same addresses every time, so one CUDA graph
can replay them all from a single host call. flowlock's strict path can be captured as it is: it
validates its structural inputs with host read-backs memoized per tensor before the first launch,
launches nothing that synchronizes with the host, and its prepared launches read the current stream
and encode tensor maps by address at launch time.

:func:`capture` runs ``fn(**inputs)`` on copies of ``inputs`` that it owns, first eagerly (warm-up:
kernel builds, launch plans, memoized checks), then once under stream capture, and returns a
:class:`CapturedCall`. Calling that with new values for some inputs checks them, copies them into the
owned copies and replays the graph.

Guarantees:

* a replay launches the kernels of the captured call with the same arguments, so its results are
  the bits ``fn`` gives eagerly on the same values (the GPU tests check this for the strict H3
  forward and training step);
* nothing is copied and nothing runs unless every update is valid: a known, non-fixed input name,
  the captured shape, dtype and device, and the caller's ``validate``;
* a replay is refused with :class:`GraphInvalidated` when a parameter or buffer of ``modules`` no
  longer has the storage, shape, strides or dtype it had at capture (the graph would read memory that
  is no longer the weight). In-place updates such as an optimizer step keep the storage and are fine.

Memoized values that the captured call read (flowlock's row maps and RoPE tables are memoized per
index tensor) are keyed on the owned copies, which nothing else can reach, so they live as long as the
graph. A training step's gradients belong to the graph: every parameter of ``modules`` must have no
``.grad`` at capture, each replay overwrites the gradients with that call's (no accumulation across
replays) and rebinds ``.grad`` to them. The outputs are the same tensors after every replay; the next
replay overwrites them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn


class GraphInvalidated(RuntimeError):
    """A replay was refused: something the graph reads changed storage since capture."""


def _storage(t: torch.Tensor) -> tuple:
    return t.data_ptr(), t.dtype, t.shape, t.stride()


def registered_tensors(modules: Iterable[nn.Module]) -> list[torch.Tensor]:
    """Every parameter and buffer of ``modules``, depth first (a module's own, then its children's in
    registration order), once per place it is registered.

    It reads the modules' registration dicts itself rather than calling ``named_parameters``, which
    builds a name for every tensor through nested generators: before every replay of the 33B model
    (639 tensors in 1,107 modules) the check took 2.5-5.2 ms of host time on a 2-core CPU host, all of
    it before the graph's first kernel, and takes 0.76-1.35 ms this way (docs/performance.md)."""
    found = []
    stack = list(modules)[::-1]
    while stack:
        registered = stack.pop().__dict__
        found.extend(registered["_parameters"].values())
        found.extend(registered["_buffers"].values())
        children = registered["_modules"]
        if children:
            stack.extend(c for c in reversed(children.values()) if c is not None)
    return [t for t in found if t is not None]


def registered_tensor_names(modules: Iterable[nn.Module]) -> list[str]:
    """The qualified names of :func:`registered_tensors`'s tensors, in its order (``named_modules``
    walks the same preorder), built only to name a tensor in an error."""
    return [".".join(filter(None, (str(i), path, key)))
            for i, module in enumerate(modules)
            for path, sub in module.named_modules(remove_duplicate=False)
            for registered in (sub._parameters, sub._buffers)
            for key, t in registered.items() if t is not None]


class CapturedCall:
    """A captured ``fn(**inputs)``; call it with new values for some inputs to replay it.

    Made by :func:`capture` right after the capture, from the graph (anything with ``replay()``),
    the owned inputs and ``fn``'s outputs: the storage of ``modules``' parameters and buffers and the
    gradients the capture left on them and on the owned inputs are read then. ``outputs``: what
    ``fn`` returned at capture, rewritten by every replay. ``input_grads``: the gradients of the owned
    inputs that require one (a training step's latent gradients), likewise.
    """

    def __init__(self, graph: Any, static: dict[str, torch.Tensor], outputs: Any, *, fixed: Iterable[str] = (),
                 validate: Callable[[Mapping[str, torch.Tensor]], None] | None = None,
                 modules: Iterable[nn.Module] = ()):
        self._graph, self._static, self.outputs = graph, static, outputs
        self._fixed, self._validate, self._modules = frozenset(fixed), validate, tuple(modules)
        self._stamps = [_storage(t) for t in registered_tensors(self._modules)]
        self._grads = [(p, p.grad) for m in self._modules for p in m.parameters() if p.grad is not None]
        self.input_grads = {n: t.grad for n, t in static.items() if t.requires_grad and t.grad is not None}

    def __call__(self, **updates: torch.Tensor) -> Any:
        """Copy ``updates`` into the owned inputs and replay; returns :attr:`outputs`."""
        if self._graph is None:
            raise GraphInvalidated("this captured call was released")
        for name, value in updates.items():
            self._check_update(name, value)
        if self._validate is not None:
            self._validate({**self._static, **updates})
        self._check_storage()
        with torch.no_grad():  # an owned input may be a leaf that requires grad (a step's latents)
            for name, value in updates.items():
                self._static[name].copy_(value)
        self._graph.replay()
        for param, grad in self._grads:
            param.grad = grad
        return self.outputs

    def _check_update(self, name: str, value: torch.Tensor) -> None:
        if name not in self._static:
            raise ValueError(f"unknown input {name!r}; captured inputs: {', '.join(sorted(self._static))}")
        if name in self._fixed:
            raise ValueError(f"input {name!r} is fixed by the capture (the graph was built for its values); "
                             "capture again for another layout")
        static = self._static[name]
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"input {name!r} must be a tensor, got {type(value).__name__}")
        if value.shape != static.shape or value.dtype != static.dtype or value.device != static.device:
            raise ValueError(f"input {name!r} must be {tuple(static.shape)} {static.dtype} on {static.device} as "
                             f"captured, got {tuple(value.shape)} {value.dtype} on {value.device}")

    def _check_storage(self) -> None:
        now = [_storage(t) for t in registered_tensors(self._modules)]
        if now == self._stamps:
            return
        if len(now) != len(self._stamps):
            raise GraphInvalidated(f"the captured modules have {len(now)} parameters and buffers, "
                                   f"{len(self._stamps)} at capture")
        name = next(n for n, a, b in zip(registered_tensor_names(self._modules), now, self._stamps) if a != b)
        raise GraphInvalidated(f"{name} changed storage, shape, strides or dtype since capture: the graph "
                               "would read its old memory; update weights in place, or capture again")

    def release(self) -> None:
        """Drop the graph, its memory and the gradients it owned (``.grad`` set to None)."""
        for param, grad in self._grads:
            if param.grad is grad:
                param.grad = None
        self._graph = None
        self._static, self._grads, self.outputs, self.input_grads = {}, [], None, {}


def capture(fn: Callable[..., Any], inputs: Mapping[str, torch.Tensor], *, modules: Iterable[nn.Module] = (),
            fixed: Iterable[str] = (), validate: Callable[[Mapping[str, torch.Tensor]], None] | None = None,
            warmup: int = 2) -> CapturedCall:
    """Capture ``fn(**inputs)`` as a CUDA graph (see the module docstring).

    ``inputs``: CUDA tensors, copied (a copy of one that requires grad requires grad). ``modules``:
    whose parameters and buffers the call reads; their storage is checked before every replay and
    their gradients, if ``fn`` runs a backward, belong to the graph. ``fixed``: input names a replay
    may not update (a layout's index tensors). ``validate(inputs)``: raises on values ``fn`` would
    refuse, called on the owned inputs with the updates in place of theirs before anything is copied
    (and once at capture). ``warmup``: eager calls before capture, at least 1.
    """
    modules = tuple(modules)
    fixed = frozenset(fixed)
    unknown = sorted(fixed - set(inputs))
    if unknown:
        raise ValueError(f"fixed names no input: {', '.join(unknown)}")
    if warmup < 1:
        raise ValueError(f"warmup must be at least 1 (the first call builds kernels and memoized checks), got {warmup}")
    for name, t in inputs.items():
        if not isinstance(t, torch.Tensor) or not t.is_cuda:
            raise ValueError(f"input {name!r} must be a CUDA tensor: a CUDA graph replays device work only")
    params = [p for m in modules for p in m.parameters()]
    holding = sorted({n for m in modules for n, p in m.named_parameters() if p.grad is not None})
    if holding:
        raise ValueError(f"every parameter must have no .grad at capture (zero_grad(set_to_none=True)), so that the "
                         f"graph's backward owns its gradients; these have one: {', '.join(holding[:5])}"
                         + (" ..." if len(holding) > 5 else ""))
    static = {n: t.detach().clone().requires_grad_(t.requires_grad) for n, t in inputs.items()}
    if validate is not None:
        validate(static)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn(**static)
                _clear_grads(params, static)
        torch.cuda.current_stream().wait_stream(side)
        # The warm-up's gradients went back to the caching allocator; release them so that the graph's
        # private pool can take that memory (a 33B model's gradients do not fit twice).
        torch.cuda.empty_cache()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = fn(**static)
    except BaseException:
        _clear_grads(params, static)
        raise
    return CapturedCall(graph, static, outputs, fixed=fixed, validate=validate, modules=modules)


def _clear_grads(params: list[nn.Parameter], static: dict[str, torch.Tensor]) -> None:
    for t in (*params, *static.values()):
        t.grad = None
