"""The grouped order in which ``linear``'s persistent GEMM kernels (Triton and Gluon) walk output tiles.

``@triton.jit`` device functions of integer scalars, which Gluon kernels call as well, so both walk
the same tiles in the same order and split the same tail: the grid rules of
:func:`flowlock.ops.linear.triton.tma_programs` hold for both.
"""

import triton
import triton.language as tl


@triton.jit
def tile_coords(tile, n_i, n_j, GROUP_I: tl.constexpr):
    """``(pid_i, pid_j)`` of walk position ``tile`` over ``n_i x n_j`` tiles: GROUP_I row tiles walk
    the columns together, so they read each column panel of B while it is in L2."""
    width = GROUP_I * n_j
    first_i = (tile // width) * GROUP_I
    size_i = tl.minimum(n_i - first_i, GROUP_I)
    pid_i = first_i + (tile % width) % size_i
    pid_j = (tile % width) // size_i
    return pid_i, pid_j


@triton.jit
def split_tail(tiles, NUM_PROGRAMS: tl.constexpr, TAIL_SPLIT: tl.constexpr):
    """How many of the last tiles run as two half-width tiles each: the partial last round of the
    persistent walk when its halves fit one round (2 * tail <= NUM_PROGRAMS), else none."""
    tail = tiles % NUM_PROGRAMS
    if not TAIL_SPLIT:
        tail = 0
    return tl.where(2 * tail <= NUM_PROGRAMS, tail, 0)
