"""A warp-specialized Hopper GEMM for ``linear``'s dW, in Gluon: a candidate, in no frozen config.

``gemm_dw(dy, x2d, c, cfg, programs)`` computes ``c (N, K) = dy (M, N).T @ x2d (M, K)`` for bf16 / fp16
operands with the bits of :mod:`flowlock.ops.linear.triton`'s TMA kernel under the same config: the
reduction over tokens in units of ``UNIT`` rows, each unit an fp32 chain of k16 wgmma steps from
zero, the unit sums folded left, ascending, into a running total that starts at +0.0 (so a unit sum
of -0.0 folds to +0.0, as there), rounded once. One producer warp issues the TMA loads (dY's block
read transposed, x's block as two half-width boxes) into a ring of ``RING`` stages; the default
partition's two warpgroups issue the wgmma of the 128 x 256 tile as two 128-wide halves (each element
is one k16 chain whatever the instruction's width: the split tail's half tiles have the same bits)
and fold each finished unit into the total.

Why the total lives in shared memory: the Triton kernel keeps the unit sum and the total of its
128 x 256 tile in registers, 256 fp32 a thread, and spills. Here the unit sum stays in registers
(two 64-register halves) and the total is a 128 KiB fp32 tile in shared memory, read, added and
written one half at a time at each unit's end (a 64-register peak), and the final half-tiles are
rounded into the first half of their own total region for the TMA store. That leaves room for a
ring of two stages.

Synchronization is :mod:`flowlock.ops.linear.gluon`'s (ready / empty mbarriers per stage; an arrive in
the 8-warp partition is a barrier over it then one arrive). A thread reads back only the total
elements it wrote, so a fold needs no barrier, except the last, whose rounded values overwrite other
threads' elements: a barrier over the partition after every thread's read. The TMA store of a tile's
result is waited for before the next tile zeroes the total.
"""

from __future__ import annotations

import torch
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

from flowlock.config import LaunchConfig
from flowlock.ops.linear.gluon import LOADER_REGS, LOADER_WARPS, SHARED_BYTES, ring_barriers
from flowlock.ops.linear.tile_order import tile_coords


@gluon.jit
def _dw_loader(a_desc, b_half_desc, a_bufs, b_bufs, ready, empty, I, J, R, BLOCK_I: gl.constexpr,
               BLOCK_J: gl.constexpr, BLOCK_R: gl.constexpr, GROUP_I: gl.constexpr, RING: gl.constexpr,
               NUM_PROGRAMS: gl.constexpr):
    n_i = gl.cdiv(I, BLOCK_I)
    n_j = gl.cdiv(J, BLOCK_J)
    n_k = gl.cdiv(R, BLOCK_R)
    nbytes: gl.constexpr = a_desc.block_type.nbytes + 2 * b_half_desc.block_type.nbytes
    count = 0
    for tile in range(gl.program_id(0), n_i * n_j, NUM_PROGRAMS):
        pid_i, pid_j = tile_coords(tile, n_i, n_j, GROUP_I)
        for k in range(n_k):
            s = count % RING
            # A fresh barrier counts as having completed the phase before its first: parity 1 passes.
            mbarrier.wait(empty.index(s), ((count // RING) & 1) ^ 1)
            mbarrier.expect(ready.index(s), nbytes)
            tma.async_copy_global_to_shared(a_desc, [k * BLOCK_R, pid_i * BLOCK_I], ready.index(s), a_bufs.index(s))
            for h in gl.static_range(2):
                tma.async_copy_global_to_shared(b_half_desc, [k * BLOCK_R, pid_j * BLOCK_J + h * (BLOCK_J // 2)],
                                                ready.index(s), b_bufs.index(2 * s + h))
            count += 1


@gluon.jit
def _fold(acc, total, c_half_desc, oi, oj, last):
    """total += acc (the unit sum), in fp32; on the tile's last unit, round and TMA-store instead."""
    t = total.load(acc.type.layout) + acc
    if last:
        # The rounded tile overwrites the total's first bytes, where other threads' fp32 elements
        # live: every thread has read its elements before any writes.
        gl.thread_barrier()
        view = total._reinterpret(c_half_desc.dtype, c_half_desc.block_type.shape, c_half_desc.layout)
        view.store(t.to(c_half_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(c_half_desc, [oi, oj], view)
    else:
        total.store(t)


@gluon.jit
def _dw_consumer(c_half_desc, a_bufs, b_bufs, total, ready, empty, I, J, R, UNIT: gl.constexpr,
                 BLOCK_I: gl.constexpr, BLOCK_J: gl.constexpr, BLOCK_R: gl.constexpr, GROUP_I: gl.constexpr,
                 RING: gl.constexpr, NUM_PROGRAMS: gl.constexpr, num_warps: gl.constexpr):
    HALF: gl.constexpr = BLOCK_J // 2
    STEPS: gl.constexpr = UNIT // BLOCK_R
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                     instr_shape=[16, HALF, 16])
    n_i = gl.cdiv(I, BLOCK_I)
    n_j = gl.cdiv(J, BLOCK_J)
    n_k = gl.cdiv(R, BLOCK_R)
    count = 0
    for tile in range(gl.program_id(0), n_i * n_j, NUM_PROGRAMS):
        pid_i, pid_j = tile_coords(tile, n_i, n_j, GROUP_I)
        oi = pid_i * BLOCK_I
        oj = pid_j * BLOCK_J
        tma.store_wait(pendings=0)  # the previous tile's result has left the total's shared memory
        zero = gl.zeros((BLOCK_I, HALF), dtype=gl.float32, layout=layout)
        total.index(0).store(zero)
        total.index(1).store(zero)
        acc0 = gl.zeros((BLOCK_I, HALF), dtype=gl.float32, layout=layout)
        acc1 = gl.zeros((BLOCK_I, HALF), dtype=gl.float32, layout=layout)
        for k in range(n_k):
            s = count % RING
            mbarrier.wait(ready.index(s), (count // RING) & 1)
            a = a_bufs.index(s).permute((1, 0))
            within = k % STEPS != 0  # a unit's first step starts its sum from zero
            acc0 = warpgroup_mma(a, b_bufs.index(2 * s), acc0, use_acc=within, is_async=True)
            acc1 = warpgroup_mma(a, b_bufs.index(2 * s + 1), acc1, use_acc=within, is_async=True)
            # Keep this step's two wgmma in flight; the previous step's are done, so its stage is free.
            acc0, acc1 = warpgroup_mma_wait(2, deps=(acc0, acc1))
            mbarrier.arrive(empty.index((count + RING - 1) % RING), pred=k > 0)
            if ((k + 1) % STEPS == 0) | (k == n_k - 1):
                acc0, acc1 = warpgroup_mma_wait(0, deps=(acc0, acc1))
                _fold(acc0, total.index(0), c_half_desc, oi, oj, k == n_k - 1)
                _fold(acc1, total.index(1), c_half_desc, oi, oj + HALF, k == n_k - 1)
            count += 1
        mbarrier.arrive(empty.index((count + RING - 1) % RING))
    tma.store_wait(pendings=0)


@gluon.jit
def _linear_dw_ws_kernel(a_desc, b_half_desc, c_half_desc, I, J, R, UNIT: gl.constexpr, BLOCK_I: gl.constexpr,
                         BLOCK_J: gl.constexpr, BLOCK_R: gl.constexpr, GROUP_I: gl.constexpr, RING: gl.constexpr,
                         NUM_PROGRAMS: gl.constexpr, LOADER_WARPS: gl.constexpr, LOADER_REGS: gl.constexpr,
                         num_warps: gl.constexpr):
    """``C (I, J) = A (R, I)^T @ B (R, J)`` folded over token units of UNIT rows: A = dY, B = x, C = dW.
    Descriptors: A's block (BLOCK_R, BLOCK_I), B's and C's half-width blocks."""
    dtype: gl.constexpr = a_desc.dtype
    HALF: gl.constexpr = BLOCK_J // 2
    a_bufs = gl.allocate_shared_memory(dtype, [RING, BLOCK_R, BLOCK_I], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [2 * RING, BLOCK_R, HALF], b_half_desc.layout)
    total_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_I, HALF], gl.float32)
    total = gl.allocate_shared_memory(gl.float32, [2, BLOCK_I, HALF], total_layout)
    ready, empty = ring_barriers(RING)
    gl.warp_specialize([
        (_dw_consumer, (c_half_desc, a_bufs, b_bufs, total, ready, empty, I, J, R, UNIT, BLOCK_I, BLOCK_J, BLOCK_R,
                        GROUP_I, RING, NUM_PROGRAMS, num_warps)),
        (_dw_loader, (a_desc, b_half_desc, a_bufs, b_bufs, ready, empty, I, J, R, BLOCK_I, BLOCK_J, BLOCK_R,
                      GROUP_I, RING, NUM_PROGRAMS)),
    ], [LOADER_WARPS], [LOADER_REGS])


def applies(cfg: LaunchConfig, a: torch.Tensor, a_t: bool, b: torch.Tensor, b_t: bool, c: torch.Tensor) -> bool:
    """Whether ``cfg`` runs this product on the Gluon dW kernel: it asks for it (``GLUON``), the product
    is a dW (A stored transposed, B as stored, token units) on a CUDA device, and A, B and C share one
    16-bit float dtype."""
    return (bool(dict(cfg.blocks).get("GLUON", 0)) and c.is_cuda and a_t and not b_t and cfg["UNIT"] > 0
            and a.dtype in (torch.bfloat16, torch.float16) and a.dtype == b.dtype == c.dtype)


def shared_bytes(cfg: LaunchConfig, element_size: int = 2) -> int:
    """Shared memory of one program under ``cfg``: the ring of A and B blocks and the fp32 total tile."""
    bi, bj, br = cfg["BLOCK_I"], cfg["BLOCK_J"], cfg["BLOCK_R"]
    return element_size * cfg["RING"] * (bi + bj) * br + 4 * bi * bj


def _descriptor(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    dt = gl.bfloat16 if t.dtype == torch.bfloat16 else gl.float16
    return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, dt))


def descriptors(dy: torch.Tensor, x2d: torch.Tensor, c: torch.Tensor, cfg: LaunchConfig
                ) -> tuple[TensorDescriptor, ...]:
    """The kernel's A (dY), half-width B (x) and half-width C (dW) descriptors."""
    bi, bj, br = cfg["BLOCK_I"], cfg["BLOCK_J"], cfg["BLOCK_R"]
    return _descriptor(dy, [br, bi]), _descriptor(x2d, [br, bj // 2]), _descriptor(c, [bi, bj // 2])


def gemm_dw(dy: torch.Tensor, x2d: torch.Tensor, c: torch.Tensor, cfg: LaunchConfig, programs: int) -> torch.Tensor:
    """``c (N, K) = dy (M, N).T @ x2d (M, K)`` over token units of ``cfg["UNIT"]``, on ``programs``
    persistent programs; all TMA-ready and :func:`applies` holds. Raises before launching when the
    ring and the total do not fit in shared memory or a unit is not whole BLOCK_R steps."""
    if shared_bytes(cfg, dy.element_size()) > SHARED_BYTES:
        raise ValueError(f"linear Gluon dW config {cfg} needs {shared_bytes(cfg, dy.element_size())} bytes of "
                         f"shared memory per program; sm90 has {SHARED_BYTES}")
    if cfg["UNIT"] % cfg["BLOCK_R"]:
        raise ValueError(f"linear Gluon dW config {cfg}: UNIT must be a multiple of BLOCK_R")
    i_dim, j_dim = c.shape
    _linear_dw_ws_kernel[(programs,)](
        *descriptors(dy, x2d, c, cfg), i_dim, j_dim, dy.shape[0], UNIT=cfg["UNIT"], BLOCK_I=cfg["BLOCK_I"],
        BLOCK_J=cfg["BLOCK_J"], BLOCK_R=cfg["BLOCK_R"], GROUP_I=cfg["GROUP_I"], RING=cfg["RING"],
        NUM_PROGRAMS=programs, LOADER_WARPS=LOADER_WARPS, LOADER_REGS=LOADER_REGS, num_warps=cfg.num_warps)
    return c
