"""A warp-specialized Hopper GEMM for ``linear``'s forward, in Gluon: a candidate, in no frozen config.

``linear_fwd_ws(x2d, weight)`` computes what :func:`flowlock.ops.linear.triton.linear_fwd` computes
for bf16 / fp16 operands without bias, with the work split between warps as cuBLAS's Hopper kernels
split it: one producer warp only issues the TMA loads of A and B into a ring of ``STAGES`` shared
buffers, and the default partition's two warpgroups only issue the wgmma of the 128 x 256 tile (64
rows each) and store the result, so loads for the next steps and the next tile are in flight while
the tensor cores run. Tiles are walked persistently in the Triton kernel's grouped order.

Bits: every output element is, as in the Triton kernel, one fp32 chain of k16 wgmma steps ascending
over K from a zero accumulator (the first step of a tile with the accumulator off, as Triton's own
zero-init rewrite issues it), rounded once to nearest even; ``BLOCK_R`` is the frozen config's. A
GPU test compares the two bitwise (``tests/ops/test_linear_gluon_gpu.py``).

Synchronization: ``ready[s]`` completes when stage s's two TMA loads have landed (expect-tx);
``empty[s]`` when the wgmma reading stage s are done. Gluon lowers an arrive in a multi-warp partition
as a barrier over the partition's warps then one arrive, so ``empty[s]`` completes only after both
warpgroups have waited for their wgmma on it: a stage is never refilled while either still reads it.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# Tile, ring depth and warps of the candidate: the frozen bf16 forward tile (128 x 256, BLOCK_R 64).
BLOCK_I, BLOCK_J, BLOCK_R, GROUP_I, STAGES, WARPS = 128, 256, 64, 8, 3, 8
# The producer partition: one warp, few registers (it computes tile coordinates and issues TMA).
LOADER_WARPS, LOADER_REGS = 1, 40


@gluon.jit
def _tile_coords(tile, n_i, n_j, GROUP_I: gl.constexpr):
    """The Triton kernel's grouped tile order."""
    width = GROUP_I * n_j
    first_i = (tile // width) * GROUP_I
    size_i = gl.minimum(n_i - first_i, GROUP_I)
    pid_i = first_i + (tile % width) % size_i
    pid_j = (tile % width) // size_i
    return pid_i, pid_j


@gluon.jit
def _loader(a_desc, b_desc, a_bufs, b_bufs, ready, empty, I, J, R, BLOCK_I: gl.constexpr, BLOCK_J: gl.constexpr,
            BLOCK_R: gl.constexpr, GROUP_I: gl.constexpr, STAGES: gl.constexpr, NUM_PROGRAMS: gl.constexpr):
    n_i = gl.cdiv(I, BLOCK_I)
    n_j = gl.cdiv(J, BLOCK_J)
    n_k = gl.cdiv(R, BLOCK_R)
    count = 0
    for tile in range(gl.program_id(0), n_i * n_j, NUM_PROGRAMS):
        pid_i, pid_j = _tile_coords(tile, n_i, n_j, GROUP_I)
        for k in range(n_k):
            s = count % STAGES
            # A fresh barrier counts as having completed the phase before its first: parity 1 passes.
            mbarrier.wait(empty.index(s), ((count // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [pid_i * BLOCK_I, k * BLOCK_R], ready.index(s), a_bufs.index(s))
            tma.async_copy_global_to_shared(b_desc, [pid_j * BLOCK_J, k * BLOCK_R], ready.index(s), b_bufs.index(s))
            count += 1


@gluon.jit
def _consumer(c_desc, a_bufs, b_bufs, c_smem, ready, empty, I, J, R, BLOCK_I: gl.constexpr, BLOCK_J: gl.constexpr,
              BLOCK_R: gl.constexpr, GROUP_I: gl.constexpr, STAGES: gl.constexpr, NUM_PROGRAMS: gl.constexpr,
              num_warps: gl.constexpr):
    # One m64 x n256 x k16 wgmma per warpgroup and k16 step: the instruction tl.dot issues for this tile.
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                     instr_shape=[16, BLOCK_J, 16])
    n_i = gl.cdiv(I, BLOCK_I)
    n_j = gl.cdiv(J, BLOCK_J)
    n_k = gl.cdiv(R, BLOCK_R)
    count = 0
    for tile in range(gl.program_id(0), n_i * n_j, NUM_PROGRAMS):
        pid_i, pid_j = _tile_coords(tile, n_i, n_j, GROUP_I)
        acc = gl.zeros((BLOCK_I, BLOCK_J), dtype=gl.float32, layout=layout)
        for k in range(n_k):
            s = count % STAGES
            mbarrier.wait(ready.index(s), (count // STAGES) & 1)
            acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, use_acc=k > 0,
                                is_async=True)
            # Keep this step's wgmma in flight; the previous step's is done, so its stage is free.
            acc = warpgroup_mma_wait(1, deps=(acc,))
            mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES), pred=k > 0)
            count += 1
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index((count + STAGES - 1) % STAGES))
        tma.store_wait(pendings=0)  # the previous tile's store has read c_smem
        c_smem.store(acc.to(c_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [pid_i * BLOCK_I, pid_j * BLOCK_J], c_smem)
    tma.store_wait(pendings=0)


@gluon.jit
def _linear_fwd_ws_kernel(a_desc, b_desc, c_desc, I, J, R, BLOCK_I: gl.constexpr, BLOCK_J: gl.constexpr,
                          BLOCK_R: gl.constexpr, GROUP_I: gl.constexpr, STAGES: gl.constexpr,
                          NUM_PROGRAMS: gl.constexpr, LOADER_WARPS: gl.constexpr, LOADER_REGS: gl.constexpr,
                          num_warps: gl.constexpr):
    """``C (I, J) = A (I, R) @ B (J, R)^T``: A = x, B = weight, C = out; all descriptors of this module."""
    dtype: gl.constexpr = a_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_I, BLOCK_R], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_J, BLOCK_R], b_desc.layout)
    c_smem = gl.allocate_shared_memory(dtype, [BLOCK_I, BLOCK_J], c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    gl.warp_specialize([
        (_consumer, (c_desc, a_bufs, b_bufs, c_smem, ready, empty, I, J, R, BLOCK_I, BLOCK_J, BLOCK_R, GROUP_I,
                     STAGES, NUM_PROGRAMS, num_warps)),
        (_loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, I, J, R, BLOCK_I, BLOCK_J, BLOCK_R, GROUP_I,
                   STAGES, NUM_PROGRAMS)),
    ], [LOADER_WARPS], [LOADER_REGS])


def descriptors(x2d: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> tuple[TensorDescriptor, ...]:
    """The kernel's A, B and C descriptors for ``x2d (M, K)``, ``weight (N, K)``, ``out (M, N)``."""
    dt = gl.bfloat16 if x2d.dtype == torch.bfloat16 else gl.float16

    def desc(t, block):
        return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, dt))

    return desc(x2d, [BLOCK_I, BLOCK_R]), desc(weight, [BLOCK_J, BLOCK_R]), desc(out, [BLOCK_I, BLOCK_J])


def linear_fwd_ws(x2d: torch.Tensor, weight: torch.Tensor, programs: int) -> torch.Tensor:
    """``x2d (M, K) @ weight (N, K).T`` -> ``(M, N)`` in their dtype (bf16 or fp16; contiguous, N and K
    multiples of 8, M > 0), on at most ``programs`` persistent programs (one per SM). Trusted inputs."""
    m, n, k = x2d.shape[0], weight.shape[0], x2d.shape[1]
    out = torch.empty((m, n), dtype=x2d.dtype, device=x2d.device)
    grid = min(programs, triton.cdiv(m, BLOCK_I) * triton.cdiv(n, BLOCK_J))
    _linear_fwd_ws_kernel[(grid,)](*descriptors(x2d, weight, out), m, n, k, BLOCK_I, BLOCK_J, BLOCK_R, GROUP_I,
                                   STAGES, grid, LOADER_WARPS, LOADER_REGS, num_warps=WARPS)
    return out
