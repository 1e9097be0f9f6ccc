"""A leaner host path for launching flowlock's Triton kernels.

``fast_launch(kernel)`` wraps a ``@triton.jit`` kernel; ``wrapped[grid](*args, **kwargs)`` means
exactly what ``kernel[grid](*args, **kwargs)`` means. The first launch of each specialization goes
through Triton (compile, cache, launch) and the compiled kernel is kept; later launches with the
same specialization call that compiled kernel's launcher directly, skipping the rest of Triton's
per-launch Python (option defaults, the cache-key string, hook and launch-metadata handling). On an
H200 host that is about 10 us of the 20-30 us a launch costs, which matters at small S where an op's
GPU work is tens of microseconds.

The cache key is Triton's own argument binding (the same native specialization of every argument:
pointer dtype and 16-byte alignment, integer value 1 and divisibility by 16, constexpr values), the
launch options and the device, so a cached kernel is reused only where Triton would pick the same
one. Under the interpreter, with a callable grid, or while a Triton launch hook is installed (a
profiler such as proton), every launch takes Triton's own path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from triton import knobs
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction


class FastLaunch:
    """A ``@triton.jit`` kernel launched through a per-specialization cache of compiled kernels."""

    def __init__(self, kernel: JITFunction):
        # Under TRITON_INTERPRET=1, @triton.jit makes an InterpretedFunction (always launched plainly).
        if not isinstance(kernel, (JITFunction, InterpretedFunction)):
            raise TypeError(f"fast_launch wraps a @triton.jit kernel, got {type(kernel).__name__}")
        self.kernel = kernel
        self._interpreted = isinstance(kernel, InterpretedFunction)
        self._compiled: dict[tuple, object] = {}

    def __getitem__(self, grid) -> Callable[..., object]:
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _launch(self, grid, args: tuple, kwargs: dict) -> object:
        if self._interpreted or callable(grid) or knobs.runtime.launch_enter_hook.calls:
            return self.kernel[grid](*args, **kwargs)
        device = torch.cuda.current_device()
        binder = self.kernel.device_caches[device][4]
        bound, specialization, options = binder(*args, **kwargs)
        key = (device, tuple(specialization), tuple(options.items()))
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self.kernel[grid](*args, **kwargs)
            self._compiled[key] = compiled
            return compiled
        dims = tuple(grid) + (1, 1)
        compiled.run(dims[0], dims[1], dims[2], torch._C._cuda_getCurrentRawStream(device), compiled.function,
                     compiled.packed_metadata, None, None, None, *bound.values())
        return compiled


def fast_launch(kernel: JITFunction) -> FastLaunch:
    """Decorator for host-launched kernels (below ``@triton.jit``); never for device functions,
    which other kernels call and Triton must see as ``JITFunction``."""
    return FastLaunch(kernel)
