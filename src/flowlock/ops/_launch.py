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
arguments and no binding, specialization or cache lookup at all. A kernel whose leading parameters
are host tensor descriptors is prepared with descriptors and relaunched with tensors in their
place (:class:`DescriptorLaunch`): each tensor's CUDA tensor map is encoded once per address, not
rebuilt and re-encoded on every launch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import triton
from triton import knobs
from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST, CudaLauncher
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction
from triton.tools.tensor_descriptor import TensorDescriptor

# Host tensor descriptors a prepared launch takes tensors in place of: Triton's and Gluon's (which also
# carries its shared layout; the tensor map is made from the compiled kernel's metadata either way).
_DESCRIPTORS = (TensorDescriptor, GluonTensorDescriptor)
# Encoded tensor maps one descriptor parameter keeps (one per address); past this, it starts afresh.
# The weights of one layer type across 52 blocks plus its activations fit many times over.
_MAX_ENCODED = 1024


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
            raise TypeError(f"fast_launch wraps a @triton.jit or @gluon.jit kernel, got {type(kernel).__name__}")
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

        Leading host tensor descriptors (Triton's or Gluon's) give a :class:`DescriptorLaunch`, which takes in
        their place tensors of the same dtype, shape and strides (zero padding, as ``from_tensor``
        makes them), or ``None`` where Triton did not lower them to CUDA tensor maps.
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
        compiled, launch, head = entry
        tail = tuple(bound.values())[len(args):]
        descriptors = [a for a in args if isinstance(a, _DESCRIPTORS)]
        if not descriptors:
            return PreparedLaunch(launch, head, tail)
        if not all(isinstance(a, _DESCRIPTORS) for a in args[:len(descriptors)]):
            raise ValueError(f"{self.kernel.fn.__name__}: descriptor arguments must lead the positional ones")
        return DescriptorLaunch.of(compiled, head, descriptors, tail)


class PlanTable(dict):
    """An op's prepared launches by key, at most ``limit`` of them. A full table starts afresh rather
    than evicting one by one: keys are the layer shapes, products and token counts of a run, few
    against the limit, so a table that fills is one whose shapes churn, and a dropped plan costs only
    one launch through the compiler's own path."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit

    def keep(self, key: tuple, plan: object) -> None:
        """Keep ``plan`` under ``key``, first clearing the table where it is full."""
        if len(self) >= self.limit:
            self.clear()
        self[key] = plan


class PreparedLaunch:
    """One compiled specialization's launch: ``prepared(grid_x, stream, *args)`` launches a 1-D grid on
    ``stream`` (a raw CUDA stream handle) with new positional arguments and the constexpr values it
    was prepared with. See :meth:`FastLaunch.prepared`."""

    __slots__ = ("_launch", "_head", "_tail")

    def __init__(self, launch: Callable[..., object], head: tuple, tail: tuple):
        self._launch, self._head, self._tail = launch, head, tail

    def __call__(self, grid_x: int, stream: int, *args) -> None:
        self._launch(grid_x, 1, 1, stream, *self._head, *args, *self._tail)


class DescriptorLaunch(PreparedLaunch):
    """A :class:`PreparedLaunch` of a kernel whose first parameters are host tensor descriptors:
    ``launch(grid_x, stream, *tensors, *args)`` takes a tensor for each descriptor.

    Triton's launch builds a ``TensorDescriptor`` per tensor and encodes its CUDA tensor map on the
    host every time. A tensor map is a function of the address, shape, strides, dtype, block and
    swizzle alone, and all but the address are fixed for a prepared launch, so each descriptor
    parameter keeps the maps it has encoded by address: the weights of a layer are encoded once per
    run, an activation whenever the allocator hands out a new block. A map never refers to the tensor
    it was made for, so a freed and reused address maps the new tensor exactly as a fresh encoding.
    """

    __slots__ = ("_slots",)

    def __init__(self, launch: Callable[..., object], head: tuple, tail: tuple, slots: tuple[_DescriptorSlot, ...]):
        super().__init__(launch, head, tail)
        self._slots = slots

    @classmethod
    def of(cls, compiled: object, head: tuple, descriptors: list[TensorDescriptor], tail: tuple
           ) -> DescriptorLaunch | None:
        """The launch of ``compiled`` (whose cached plan head is ``head``) with ``descriptors`` as its
        leading arguments; ``None`` unless Triton lowered every one to a tensor map and calls the C
        launch through its own descriptor wrapper."""
        metas = getattr(compiled.metadata, "tensordesc_meta", None)
        launch = _c_launch_below_descriptor_wrapper(compiled.run)
        if launch is None or not metas or len(metas) != len(descriptors) or any(m["fp4_padded"] for m in metas):
            return None
        fill = triton.runtime.driver.active.utils.fill_tma_descriptor
        return cls(launch, head, tail, tuple(_DescriptorSlot(d, m, fill) for d, m in zip(descriptors, metas)))

    def __call__(self, grid_x: int, stream: int, *args) -> None:
        n = len(self._slots)
        encoded = [x for slot, t in zip(self._slots, args) for x in slot.encode(t)]
        self._launch(grid_x, 1, 1, stream, *self._head, *encoded, *args[n:], *self._tail)


class _DescriptorSlot:
    """One descriptor parameter of a :class:`DescriptorLaunch`: the C launch arguments it expands to
    (tensor map, shape, strides, as Triton's ``make_tensordesc_arg`` makes them), by address."""

    __slots__ = ("_fill", "_fill_args", "_dims", "_encoded")

    def __init__(self, descriptor: TensorDescriptor, meta: dict, fill: Callable[..., object]):
        shape, strides = [int(d) for d in descriptor.shape], [int(d) for d in descriptor.strides]
        padding = 1 if descriptor.padding == "nan" else 0
        self._fill = fill
        self._fill_args = (meta["swizzle"], meta["elem_size"], TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]],
                           meta["block_size"], shape, strides, padding)
        self._dims = (*shape, *strides)
        self._encoded: dict[int, tuple] = {}

    def encode(self, tensor: torch.Tensor) -> tuple:
        address = tensor.data_ptr()
        args = self._encoded.get(address)
        if args is None:
            if len(self._encoded) >= _MAX_ENCODED:
                self._encoded.clear()
            args = self._encoded[address] = (self._fill(address, *self._fill_args), *self._dims)
        return args


def _c_launch_below_descriptor_wrapper(run: object) -> Callable[..., object] | None:
    """The compiled module's C ``launch`` that Triton's ``wrap_handle_tensordesc`` wraps in a
    scratch-free CUDA launcher, or ``None`` for any other launcher."""
    if not (isinstance(run, CudaLauncher) and run.global_scratch_size == 0 and run.profile_scratch_size == 0):
        return None
    wrapper = run.launch
    code = getattr(wrapper, "__code__", None)
    if (getattr(wrapper, "__qualname__", "") != "wrap_handle_tensordesc.<locals>.inner"
            or "launcher" not in code.co_freevars):
        return None
    return wrapper.__closure__[code.co_freevars.index("launcher")].cell_contents


def launch_hooked() -> bool:
    """True while a Triton launch hook (a profiler such as proton) is installed: prepared launches
    would bypass it, so their callers take ``self[grid]`` then."""
    return bool(knobs.runtime.launch_enter_hook.calls)


def fast_launch(kernel: JITFunction) -> FastLaunch:
    """Decorator for host-launched kernels (below ``@triton.jit`` or ``@gluon.jit``); never for device functions,
    which other kernels call and Triton must see as ``JITFunction``."""
    return FastLaunch(kernel)
