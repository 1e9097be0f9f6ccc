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

``prepared(*args, **kwargs)`` goes one step further for an op whose launches repeat with arguments it
can vouch for: it hands back the compiled launch itself, which the op calls with new positional
arguments and no binding, specialization or cache lookup at all.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from triton import knobs
from triton.backends.nvidia.driver import CudaLauncher
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction


def launch_plan(compiled: object) -> tuple[Callable[..., object], tuple]:
    """``(launch, head)`` with ``launch(gx, gy, gz, stream, *head, *args)`` launching ``compiled`` as its
    own ``compiled.run(gx, gy, gz, stream, compiled.function, compiled.packed_metadata, None, None, None,
    *args)`` does when no launch hook is installed.

    A CUDA launcher without scratch buffers is skipped: its ``__call__`` only allocates no scratch and
    passes the kernel's fixed cooperative-grid and PDL flags on to its C ``launch``, so calling that
    directly saves a Python frame and two closures per launch. Any other launcher (global or profile
    scratch to allocate per grid, another backend) is called as Triton calls it.
    """
    run = compiled.run
    if isinstance(run, CudaLauncher) and run.global_scratch_size == 0 and run.profile_scratch_size == 0:
        return run.launch, (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None,
                            compiled.packed_metadata, None, None, None)
    return run, (compiled.function, compiled.packed_metadata, None, None, None)


class FastLaunch:
    """A ``@triton.jit`` kernel launched through a per-specialization cache of compiled kernels."""

    def __init__(self, kernel: JITFunction):
        # Under TRITON_INTERPRET=1, @triton.jit makes an InterpretedFunction (always launched plainly).
        if not isinstance(kernel, (JITFunction, InterpretedFunction)):
            raise TypeError(f"fast_launch wraps a @triton.jit kernel, got {type(kernel).__name__}")
        self.kernel = kernel
        self._interpreted = isinstance(kernel, InterpretedFunction)
        # key -> (compiled kernel, launch, head): see launch_plan.
        self._compiled: dict[tuple, tuple] = {}

    def __getitem__(self, grid) -> Callable[..., object]:
        # A partial calls _launch without an extra Python frame for the launch arguments.
        return functools.partial(self._launch, grid)

    def _launch(self, grid, *args, **kwargs) -> object:
        if self._interpreted or callable(grid) or knobs.runtime.launch_enter_hook.calls:
            return self.kernel[grid](*args, **kwargs)
        # torch.cuda.current_device() minus its Python wrapper (the C call initializes CUDA itself).
        device = torch._C._cuda_getDevice()
        bound, specialization, options = self.kernel.device_caches[device][4](*args, **kwargs)
        key = (device, tuple(specialization), tuple(options.items()))
        entry = self._compiled.get(key)
        if entry is None:
            compiled = self.kernel[grid](*args, **kwargs)
            # None: a jit_cache_hook took the launch over, so there is no kernel to keep.
            if compiled is not None:
                self._compiled[key] = (compiled, *launch_plan(compiled))
            return compiled
        compiled, launch, head = entry
        stream = torch._C._cuda_getCurrentRawStream(device)
        n = len(grid)
        launch(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream, *head, *bound.values())
        return compiled

    def prepared(self, *args, **kwargs) -> PreparedLaunch | None:
        """The compiled kernel a launch with these arguments runs, as a :class:`PreparedLaunch` that
        takes only the positional arguments; ``None`` under the interpreter, while a launch hook is
        installed, or before this specialization has been launched once through ``self[grid]``.

        ``args`` are the kernel's leading parameters and ``kwargs`` the rest, all constexpr. The
        prepared launch is valid for new values of ``args`` that Triton specializes the same way
        (tensor dtypes and 16-byte alignment, integer values 1 and divisibility by 16); checking that
        is the caller's job, which is what makes relaunching cheaper than ``self[grid]``.
        """
        if self._interpreted or knobs.runtime.launch_enter_hook.calls:
            return None
        params = self.kernel.params
        if not all(p.is_constexpr for p in params[len(args):]):
            raise ValueError(f"{self.kernel.fn.__name__}: every parameter after the positional ones must be constexpr")
        device = torch._C._cuda_getDevice()
        bound, specialization, options = self.kernel.device_caches[device][4](*args, **kwargs)
        entry = self._compiled.get((device, tuple(specialization), tuple(options.items())))
        if entry is None:
            return None
        _, launch, head = entry
        return PreparedLaunch(launch, head, tuple(bound.values())[len(args):])


class PreparedLaunch:
    """One compiled specialization's launch: ``prepared(grid_x, stream, *args)`` launches a 1-D grid on
    ``stream`` (a raw CUDA stream handle) with new positional arguments and the constexpr values it
    was prepared with. See :meth:`FastLaunch.prepared`."""

    __slots__ = ("_launch", "_head", "_tail")

    def __init__(self, launch: Callable[..., object], head: tuple, tail: tuple):
        self._launch, self._head, self._tail = launch, head, tail

    def __call__(self, grid_x: int, stream: int, *args) -> None:
        self._launch(grid_x, 1, 1, stream, *self._head, *args, *self._tail)


def launch_hooked() -> bool:
    """True while a Triton launch hook (a profiler such as proton) is installed: prepared launches
    would bypass it, so their callers take ``self[grid]`` then."""
    return bool(knobs.runtime.launch_enter_hook.calls)


def fast_launch(kernel: JITFunction) -> FastLaunch:
    """Decorator for host-launched kernels (below ``@triton.jit``); never for device functions,
    which other kernels call and Triton must see as ``JITFunction``."""
    return FastLaunch(kernel)
