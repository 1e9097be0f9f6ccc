"""The fp32 tile product of flowlock's kernels, with bits that do not depend on the host CPU when
interpreted.

Compiled, :func:`dot_f32` is ``tl.dot(a, b, input_precision="ieee")``: true fp32 (no TF32), summed
in an order fixed by the kernel and its frozen config. Under Triton's CPU interpreter (3.6),
``tl.dot`` is ``numpy.matmul``, which hands the tile to the host's BLAS ``sgemm``. OpenBLAS picks
its kernel by CPU at run time, and the Haswell / Zen kernels (what an AVX2-only CPU selects) sum
the products of one output row in a different order depending on the row's position in the tile:
in every group of 12 rows, rows 6-11 differ from rows 0-5 in the last bits, while the
Sandybridge kernel gives every position the same bits. A sample whose rows move within a tile when
the batch changes would then change bits with the batch on some machines and not on others, and an
invariance test would be checking the host BLAS instead of the kernel.

Interpreted, :func:`dot_f32` therefore never calls BLAS: it forms the (M, K, N) products
elementwise and reduces the K axis with ``tl.sum`` (numpy's add reduction over a non-contiguous
axis: one IEEE fp32 addition per k, ascending, the same for every row and column of the tile).
Each output element is then a pure function of its own A row and B column on every CPU.

Compiled, a true-fp32 ``tl.dot`` is a chain of FMAs over K in each thread, and Triton's combine pass
rewrites ``acc + tl.dot(a, b)`` into ``tl.dot(a, b, acc)``: a kernel that sums each K block from zero
and then adds it still runs one FMA chain over the whole reduction (seen in the sm90 TTGIR), whose
error grows with K. :func:`add_compensated` is the fp32 kernels' block fold instead: a Kahan step,
whose use of the block product twice keeps the combine pass from folding it away, so the error is
that of one block plus O(eps) for the fold, whatever K is.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


@triton.jit
def dot_f32(a, b):
    """``a (M, K) @ b (K, N)`` of fp32 tiles in fp32, as an (M, N) fp32 tile."""
    if NATIVE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.sum(a[:, :, None] * b[None, :, :], axis=1)


@triton.jit
def add_compensated(acc, comp, part):
    """One Kahan step: ``(acc, comp)`` after adding ``part`` to the compensated sum ``acc``.

    ``comp`` (start at zero) holds the low-order part that ``acc`` lost, negated; the sum is ``acc``.
    Plain fp32 adds in a fixed order (Triton applies no reassociation), so the result is a pure
    function of the parts and their order.
    """
    y = part - comp
    total = acc + y
    return total, (total - acc) - y


@triton.jit
def fold_add(acc, term):
    """``acc + term``: one IEEE fp32 addition, rounded to nearest, subnormals kept (the addition of the
    TMA unit's ``.add.f32`` bulk reductions, which keep them too: the one-pass attention backward's GPU
    test feeds it subnormal sums), as a step of a fold of per-block terms.

    Compiled, it is one ``add.rn.f32`` the combine pass cannot see through: ``fold_add(c, tl.dot(a, b))``
    stays a product from zero and one addition instead of becoming ``tl.dot(a, b, c)``."""
    if NATIVE:
        return tl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=r,r,r", [acc, term], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return acc + term


# tl.dot when the kernels are compiled; the BLAS-free product when @triton.jit made interpreted
# functions (TRITON_INTERPRET=1 when Triton decorated this module).
NATIVE = tl.constexpr(not isinstance(dot_f32, InterpretedFunction))
