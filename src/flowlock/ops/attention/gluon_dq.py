"""Attention dQ for Hopper in Gluon: the Triton dQ kernel's values, with its softmax under the tensor cores.

``attention_bwd_dq_pipelined(q, k, v, dout, lse2, delta, dq, scale, ring)`` writes into ``dq`` what
:mod:`flowlock.ops.attention.triton`'s dQ kernel writes under its frozen sm90 config (128 query rows a
program, KV blocks of 64, D = 128, bf16 / fp16 operands read through descriptors). Per KV block the
Triton kernel issues ``S = Q K^T``, waits, takes ``P = exp2(S * scale' - lse)``, issues ``dP = dO V^T``,
waits, forms ``dS = P (dP - delta)`` and issues ``dQ += dS K``: its compiler places a wait right behind
every wgmma whose result is not the next block's accumulator, so the exponentials and the tensor cores
take turns. Here the wgmma are issued one block ahead, in the order ``S[j+1]``, ``dQ += dS[j] K[j]``,
``dP[j+1]``; the wait for ``S[j+1]`` alone (two groups left in flight) lets block j + 1's exponentials
run while the tensor cores compute block j's dQ product and block j + 1's ``dP``.

Bits: every element's arithmetic is the Triton kernel's, in the same order: ``S`` and ``dP`` as k16 wgmma
chains over D from the accumulator off, ``P = exp2(S * scale' - lse)`` (zero past ``seq`` in the last,
partial block), ``dS = P * (dP - delta)`` rounded to the input dtype, dQ one fp32 chain of k16 steps
ascending over the KV rows from a zero accumulator, scaled by ``scale`` and rounded once. Only the issue
order of independent wgmma groups differs. A GPU test compares the two bitwise
(``tests/ops/test_attention_gluon_dq_gpu.py``).

Shared memory: the program's Q and dO rows (32 KiB each) and a ring of ``ring`` K / V stages (32 KiB a
stage); block j's stage is refilled with block j + ring once block j + 1's wait for all groups has
passed, the last point at which its K is read.
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

from flowlock.ops._launch import fast_launch
from flowlock.ops.attention.reference import LOG2E

# Query rows of a program, KV rows of a block, head dim, warps: the Triton dQ kernel's frozen sm90 tiles.
BLOCK_M, BLOCK_N, HEAD_DIM, WARPS = 128, 64, 128, 8
# Shared memory one program may use on sm90 (227 KiB), less what the barriers and alignment take.
SHARED_BYTES = 227 * 1024 - 1024


@gluon.jit
def _load_kv(k_desc, v_desc, k_bufs, v_bufs, ready, b, col, block, n_kv, RING: gl.constexpr, BLOCK_N: gl.constexpr,
             pred):
    """TMA-load KV block ``block`` into stage ``block % RING`` (nothing when ``block >= n_kv`` or not ``pred``)."""
    s = block % RING
    go = pred & (block < n_kv)
    mbarrier.expect(ready.index(s), k_desc.block_type.nbytes + v_desc.block_type.nbytes, pred=go)
    tma.async_copy_global_to_shared(k_desc, [b, block * BLOCK_N, col], ready.index(s), k_bufs.index(s), pred=go)
    tma.async_copy_global_to_shared(v_desc, [b, block * BLOCK_N, col], ready.index(s), v_bufs.index(s), pred=go)


@gluon.jit
def _stage(bufs, block, RING: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr):
    return bufs.index(block % RING).reshape([BLOCK_N, D])


@gluon.jit
def _ds(p, dp, delta, ds_layout: gl.constexpr, dtype: gl.constexpr):
    """``dS = P * (dP - delta)`` rounded to the operand dtype, as the dQ product's register operand."""
    return gl.convert_layout((p * (dp - gl.expand_dims(delta, 1))).to(dtype), ds_layout)


@fast_launch
@gluon.jit
def _attention_bwd_dq_pipelined_kernel(q_desc, k_desc, v_desc, do_desc, Lse2, Delta, dQ, seq, heads, qk_scale,
                                       sm_scale, stride_gb, stride_gs, stride_gh,
                                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                                       RING: gl.constexpr, num_warps: gl.constexpr):
    """One program per (query block, sample * heads), as the Triton dQ kernel; descriptors over the
    (B, S, heads * D) views with [1, BLOCK_M, D] (q, dO) and [1, BLOCK_N, D] (k, v) boxes."""
    pid_m = gl.program_id(0)
    pid_bh = gl.program_id(1)
    b = pid_bh // heads
    h = pid_bh % heads
    col = h * D
    start_m = pid_m * BLOCK_M
    n_kv = gl.cdiv(seq, BLOCK_N)
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, D, 16])
    ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq_layout, k_width=2)
    rows_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

    q_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_M, D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_M, D], do_desc.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [RING, 1, BLOCK_N, D], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [RING, 1, BLOCK_N, D], v_desc.layout)
    rows_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    mbarrier.init(rows_ready, count=1)
    for s in gl.static_range(RING):
        mbarrier.init(ready.index(s), count=1)
    fence_async_shared()
    mbarrier.expect(rows_ready, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [b, start_m, col], rows_ready, q_smem)
    tma.async_copy_global_to_shared(do_desc, [b, start_m, col], rows_ready, do_smem)
    for s in gl.static_range(RING):
        _load_kv(k_desc, v_desc, k_bufs, v_bufs, ready, b, col, s, n_kv, RING, BLOCK_N, True)

    rows = start_m + gl.arange(0, BLOCK_M, layout=rows_layout)
    lse = gl.load(Lse2 + pid_bh.to(gl.int64) * seq + rows, mask=rows < seq, other=0.0)
    delta = gl.load(Delta + pid_bh.to(gl.int64) * seq + rows, mask=rows < seq, other=0.0)
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    mbarrier.wait(rows_ready, 0)
    q = q_smem.reshape([BLOCK_M, D])
    do = do_smem.reshape([BLOCK_M, D])

    mbarrier.wait(ready.index(0), 0)
    qk = warpgroup_mma(q, _stage(k_bufs, 0, RING, BLOCK_N, D).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    dp = warpgroup_mma(do, _stage(v_bufs, 0, RING, BLOCK_N, D).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    qk, dp = warpgroup_mma_wait(1, deps=(qk, dp))
    dq = gl.zeros([BLOCK_M, D], gl.float32, layout=dq_layout)
    ds = gl.zeros([BLOCK_M, BLOCK_N], dtype, layout=ds_layout)
    for j in range(n_kv - 1):
        # in flight: dQ += dS[j-1] K[j-1] and dP[j]; S[j] has landed
        p = gl.exp2(qk * qk_scale - gl.expand_dims(lse, 1))
        dq, dp, ds = warpgroup_mma_wait(0, deps=(dq, dp, ds))
        _load_kv(k_desc, v_desc, k_bufs, v_bufs, ready, b, col, j - 1 + RING, n_kv, RING, BLOCK_N, j > 0)
        ds = _ds(p, dp, delta, ds_layout, dtype)
        mbarrier.wait(ready.index((j + 1) % RING), ((j + 1) // RING) & 1)
        qk = warpgroup_mma(q, _stage(k_bufs, j + 1, RING, BLOCK_N, D).permute((1, 0)), qk, use_acc=False,
                           is_async=True)
        dq = warpgroup_mma(ds, _stage(k_bufs, j, RING, BLOCK_N, D), dq, is_async=True)
        dp = warpgroup_mma(do, _stage(v_bufs, j + 1, RING, BLOCK_N, D).permute((1, 0)), dp, use_acc=False,
                           is_async=True)
        qk, dq, dp = warpgroup_mma_wait(2, deps=(qk, dq, dp))
    last = n_kv - 1
    p = gl.exp2(qk * qk_scale - gl.expand_dims(lse, 1))
    if last * BLOCK_N + BLOCK_N > seq:
        cols = last * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        p = gl.where(gl.expand_dims(cols < seq, 0), p, 0.0)
    dq, dp, ds = warpgroup_mma_wait(0, deps=(dq, dp, ds))
    ds = _ds(p, dp, delta, ds_layout, dtype)
    dq = warpgroup_mma(ds, _stage(k_bufs, last, RING, BLOCK_N, D), dq, is_async=True)
    dq, ds = warpgroup_mma_wait(0, deps=(dq, ds))

    out_rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, dq_layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, dq_layout))
    base = dQ + b.to(gl.int64) * stride_gb + h.to(gl.int64) * stride_gh
    ptrs = base + gl.expand_dims(out_rows.to(gl.int64) * stride_gs, 1) + gl.expand_dims(cols, 0)
    gl.store(ptrs, (dq * sm_scale).to(dtype), mask=gl.expand_dims(out_rows < seq, 1))


def shared_bytes(ring: int, element_size: int = 2) -> int:
    """Shared memory of one program: Q and dO rows and ``ring`` K / V stages."""
    return (2 * BLOCK_M + 2 * ring * BLOCK_N) * HEAD_DIM * element_size


def applies(q: torch.Tensor) -> bool:
    """Whether the kernel serves these operands (given that all four are TMA-ready): D = 128, bf16 / fp16."""
    return q.shape[3] == HEAD_DIM and q.dtype in (torch.bfloat16, torch.float16)


def _descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    batch, seq, heads, dim = t.shape
    dt = gl.bfloat16 if t.dtype == torch.bfloat16 else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for([1, rows, dim], dt)
    return TensorDescriptor(t, [batch, seq, heads * dim], [t.stride(0), t.stride(1), 1], [1, rows, dim], layout)


def descriptors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor) -> tuple[TensorDescriptor, ...]:
    """The kernel's q, k, v, dO descriptors (operands ``tma_eligible`` in :mod:`flowlock.ops.attention.triton`)."""
    return _descriptor(q, BLOCK_M), _descriptor(k, BLOCK_N), _descriptor(v, BLOCK_N), _descriptor(dout, BLOCK_M)


def attention_bwd_dq_pipelined(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                               lse2: torch.Tensor, delta: torch.Tensor, dq: torch.Tensor, scale: float,
                               ring: int) -> torch.Tensor:
    """Write dQ into ``dq`` (B, S, heads, 128), contiguous in its last dim, for TMA-ready bf16 / fp16
    ``(B, S, heads, 128)`` operands, ``lse2`` and ``delta`` ``(B, heads, S)`` fp32, on ``ring`` K / V
    stages. Raises before launching when the ring does not fit in shared memory; otherwise trusted
    inputs (``attention_bwd`` validated them)."""
    if shared_bytes(ring, q.element_size()) > SHARED_BYTES:
        raise ValueError(f"a ring of {ring} K / V stages needs {shared_bytes(ring, q.element_size())} bytes of shared "
                         f"memory, over the {SHARED_BYTES} an sm90 program may use")
    batch, seq, heads, _ = q.shape
    _attention_bwd_dq_pipelined_kernel[(-(-seq // BLOCK_M), batch * heads)](
        *descriptors(q, k, v, dout), lse2, delta, dq, seq, heads, scale * LOG2E, scale,
        *dq.stride()[:3], BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, D=HEAD_DIM, RING=ring, num_warps=WARPS)
    return dq
