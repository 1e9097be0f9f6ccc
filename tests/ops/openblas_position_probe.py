"""Run in a subprocess by ``test_host_blas_independence.py`` (with ``OPENBLAS_CORETYPE`` set by the
caller): prints one JSON line saying which OpenBLAS kernel numpy runs, and whether an output row of
an interpreted fp32 tile product depends on the row's position in the tile, for Triton's own
``tl.dot`` (numpy's BLAS) and for flowlock's :func:`flowlock.ops._dot.dot_f32`."""

import ctypes
import glob
import json
import os

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from flowlock.ops._dot import dot_f32  # noqa: E402

M, K, N = 16, 32, 16


def openblas_core() -> str:
    """The kernel family numpy's OpenBLAS selected at load time (e.g. ``Haswell``)."""
    libs = glob.glob(os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs", "*openblas*"))
    for path in libs:
        lib = ctypes.CDLL(path)
        for name in ("scipy_openblas_get_corename64_", "scipy_openblas_get_corename", "openblas_get_corename"):
            fn = getattr(lib, name, None)
            if fn is not None:
                fn.restype = ctypes.c_char_p
                return fn().decode()
    raise RuntimeError(f"no OpenBLAS found beside numpy ({libs})")


@triton.jit
def _tile_product_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr,
                         FLOWLOCK: tl.constexpr):
    rows, ks, cols = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
    a = tl.load(a_ptr + rows[:, None] * K + ks[None, :])
    b = tl.load(b_ptr + ks[:, None] * N + cols[None, :])
    if FLOWLOCK:
        c = dot_f32(a, b)
    else:
        c = tl.dot(a, b, input_precision="ieee")
    tl.store(c_ptr + rows[:, None] * N + cols[None, :], c)


def position_dependent(flowlock: bool, trials: int = 8) -> bool:
    """True if one row's product bits change with the row's position in the (M, K) tile."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(trials):
        row = torch.randn(K, generator=gen)
        b = torch.randn(K, N, generator=gen)
        outs = []
        for pos in range(M):
            a = torch.randn(M, K, generator=gen)
            a[pos] = row
            c = torch.empty(M, N)
            _tile_product_kernel[(1,)](a, b, c, M, K, N, FLOWLOCK=flowlock)
            outs.append(c[pos])
        if any(not torch.equal(o, outs[0]) for o in outs):
            return True
    return False


if __name__ == "__main__":
    print(json.dumps({"core": openblas_core(), "tl_dot_position_dependent": position_dependent(False),
                      "dot_f32_position_dependent": position_dependent(True)}))
