"""Attention forward with two warpgroups that run apart, in Gluon: a candidate, in no frozen config.

``attention_fwd_ws(q, k, v, scale)`` computes what the Triton forward of
:mod:`flowlock.ops.attention.triton` computes under its frozen bf16 / fp16 sm90 config (128 query rows
a program, KV blocks of 128, D = 128), with the same values in the same order. The Triton kernel runs
the program's 128 rows as one 8-warp instruction stream, so its softmax (exponentials, row sums) and
its two wgmma per KV block take turns on the SM. Here each 64-row half is its own 4-warp partition
and the two run apart, so one half's softmax runs while the other's wgmma do (FA3's ping-pong, left
to the warp schedulers); one producer warp loads the query halves once and the KV blocks into a ring
whose stages both halves release.

Bits: a row's operations are the Triton kernel's, on the same wgmma layout per warp (m64 n128 k16,
each warp 16 rows, so row maxima and sums reduce within a warp in the same tree): scores from zero
over D, the last partial KV block's columns past ``seq`` set to -inf, the running maximum of the
scaled scores, ``P = exp2(s * scale' - m)`` rounded to the input dtype, the accumulator rescaled by
``exp2(m_old - m)`` and then ``P @ V`` onto it, the row sum folded as ``l * alpha + sum(P)``, one
division and one rounding of O, ``lse2 = m + log2(l)``. A GPU test compares the two bitwise
(``tests/ops/test_attention_gluon_fwd_gpu.py``).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from flowlock.ops.attention.reference import LOG2E

# Query rows of a program (two halves of 64, one per partition), KV rows of a block, head dim.
BLOCK_M, BLOCK_N, HEAD_DIM = 128, 128, 128
HALF = BLOCK_M // 2
# The second half's partition (one warpgroup) and the producer (one warp): warps and registers.
HALF_WARPS, HALF_REGS, LOADER_WARPS, LOADER_REGS = 4, 232, 1, 40


@gluon.jit
def _loader(q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, ready, empty, b, col, start_m, n_kv,
            HALF: gl.constexpr, BLOCK_N: gl.constexpr, RING: gl.constexpr):
    for c in gl.static_range(2):
        mbarrier.expect(q_ready.index(c), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, start_m + c * HALF, col], q_ready.index(c), q_bufs.index(c))
    for j in range(n_kv):
        s = j % RING
        # A fresh barrier counts as having completed the phase before its first: parity 1 passes.
        mbarrier.wait(empty.index(s), ((j // RING) & 1) ^ 1)
        mbarrier.expect(ready.index(s), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b, j * BLOCK_N, col], ready.index(s), k_bufs.index(s))
        tma.async_copy_global_to_shared(v_desc, [b, j * BLOCK_N, col], ready.index(s), v_bufs.index(s))


@gluon.jit
def _half(q_bufs, k_bufs, v_bufs, q_ready, ready, empty, Out, Lse2, b, h, pid_bh, start_m, seq, n_kv, qk_scale,
          stride_ob, stride_os, stride_oh, C: gl.constexpr, HALF: gl.constexpr, BLOCK_N: gl.constexpr,
          D: gl.constexpr, RING: gl.constexpr, WARPS: gl.constexpr):
    """Query rows ``start_m + C * HALF ..`` of one (sample, head): the online softmax over the KV ring."""
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                     instr_shape=[16, BLOCK_N, 16])
    rows_layout: gl.constexpr = gl.SliceLayout(1, layout)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=layout, k_width=2)
    mbarrier.wait(q_ready.index(C), 0)
    q = q_bufs.index(C).reshape([HALF, D])
    m_i = gl.full([HALF], float("-inf"), gl.float32, layout=rows_layout)
    l_i = gl.zeros([HALF], gl.float32, layout=rows_layout)
    acc = gl.zeros([HALF, D], gl.float32, layout=layout)
    for j in range(n_kv):
        s = j % RING
        mbarrier.wait(ready.index(s), (j // RING) & 1)
        k = k_bufs.index(s).reshape([BLOCK_N, D])
        v = v_bufs.index(s).reshape([BLOCK_N, D])
        qk = warpgroup_mma(q, k.permute((1, 0)), gl.zeros([HALF, BLOCK_N], gl.float32, layout=layout),
                           use_acc=False, is_async=True)
        qk = warpgroup_mma_wait(0, deps=(qk,))
        start_n = j * BLOCK_N
        if start_n + BLOCK_N > seq:
            cols = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
            qk = gl.where(gl.expand_dims(cols < seq, 0), qk, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(qk, 1) * qk_scale)
        p = gl.exp2(qk * qk_scale - gl.expand_dims(m_new, 1))
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, 1)
        acc = acc * gl.expand_dims(alpha, 1)
        p_op = gl.convert_layout(p.to(v.dtype), p_layout)
        acc = warpgroup_mma(p_op, v, acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index(s))
        m_i = m_new
    out = acc / gl.expand_dims(l_i, 1)
    rows = start_m + C * HALF + gl.arange(0, HALF, layout=rows_layout)
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    base = Out + b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh
    ptrs = base + gl.expand_dims(rows.to(gl.int64) * stride_os, 1) + gl.expand_dims(cols, 0)
    gl.store(ptrs, out.to(Out.dtype.element_ty), mask=gl.expand_dims(rows < seq, 1))
    gl.store(Lse2 + pid_bh.to(gl.int64) * seq + rows, m_i + gl.log2(l_i), mask=rows < seq)


@gluon.jit
def _half_one(q_bufs, k_bufs, v_bufs, q_ready, ready, empty, Out, Lse2, b, h, pid_bh, start_m, seq, n_kv, qk_scale,
              stride_ob, stride_os, stride_oh, HALF: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
              RING: gl.constexpr, WARPS: gl.constexpr):
    _half(q_bufs, k_bufs, v_bufs, q_ready, ready, empty, Out, Lse2, b, h, pid_bh, start_m, seq, n_kv, qk_scale,
          stride_ob, stride_os, stride_oh, 1, HALF, BLOCK_N, D, RING, WARPS)


@gluon.jit
def _attention_fwd_ws_kernel(q_desc, k_desc, v_desc, Out, Lse2, seq, heads, qk_scale, stride_ob, stride_os, stride_oh,
                             HALF: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, RING: gl.constexpr,
                             HALF_WARPS: gl.constexpr, HALF_REGS: gl.constexpr, LOADER_WARPS: gl.constexpr,
                             LOADER_REGS: gl.constexpr, num_warps: gl.constexpr):
    """One program per (2 * HALF query rows, sample * heads); descriptors over the (B, S, heads * D)
    views with [1, HALF, D] (q) and [1, BLOCK_N, D] (k, v) boxes."""
    pid_bh = gl.program_id(1)
    b = pid_bh // heads
    h = pid_bh % heads
    col = h * D
    start_m = gl.program_id(0) * (2 * HALF)
    n_kv = gl.cdiv(seq, BLOCK_N)
    dtype: gl.constexpr = q_desc.dtype
    q_bufs = gl.allocate_shared_memory(dtype, [2, 1, HALF, D], q_desc.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [RING, 1, BLOCK_N, D], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [RING, 1, BLOCK_N, D], v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(2):
        mbarrier.init(q_ready.index(c), count=1)
    for s in gl.static_range(RING):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)  # released by both halves
    gl.warp_specialize([
        (_half, (q_bufs, k_bufs, v_bufs, q_ready, ready, empty, Out, Lse2, b, h, pid_bh, start_m, seq, n_kv, qk_scale,
                 stride_ob, stride_os, stride_oh, 0, HALF, BLOCK_N, D, RING, num_warps)),
        (_half_one, (q_bufs, k_bufs, v_bufs, q_ready, ready, empty, Out, Lse2, b, h, pid_bh, start_m, seq, n_kv,
                     qk_scale, stride_ob, stride_os, stride_oh, HALF, BLOCK_N, D, RING, HALF_WARPS)),
        (_loader, (q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, ready, empty, b, col, start_m, n_kv, HALF,
                   BLOCK_N, RING)),
    ], [HALF_WARPS, LOADER_WARPS], [HALF_REGS, LOADER_REGS])


def _descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    batch, seq, heads, dim = t.shape
    dt = gl.bfloat16 if t.dtype == torch.bfloat16 else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for([1, rows, dim], dt)
    return TensorDescriptor(t, [batch, seq, heads * dim], [t.stride(0), t.stride(1), 1], [1, rows, dim], layout)


def descriptors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[TensorDescriptor, ...]:
    """The kernel's q, k, v descriptors (operands ``tma_eligible`` in :mod:`flowlock.ops.attention.triton`)."""
    return _descriptor(q, HALF), _descriptor(k, BLOCK_N), _descriptor(v, BLOCK_N)


def attention_fwd_ws(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, ring: int = 3
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out (B, S, heads, D), lse2 (B, heads, S) fp32)`` for bf16 / fp16 ``(B, S, heads, 128)`` operands
    that the Triton forward reads through descriptors, on ``ring`` KV stages. Trusted inputs."""
    batch, seq, heads, dim = q.shape
    if dim != HEAD_DIM or q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"the Gluon attention forward serves D = {HEAD_DIM} in bf16 / fp16, got D = {dim}, {q.dtype}")
    out = torch.empty_like(q)
    lse2 = torch.empty((batch, heads, seq), dtype=torch.float32, device=q.device)
    _attention_fwd_ws_kernel[(triton.cdiv(seq, BLOCK_M), batch * heads)](
        *descriptors(q, k, v), out, lse2, seq, heads, scale * LOG2E, *out.stride()[:3], HALF=HALF, BLOCK_N=BLOCK_N,
        D=HEAD_DIM, RING=ring, HALF_WARPS=HALF_WARPS, HALF_REGS=HALF_REGS, LOADER_WARPS=LOADER_WARPS,
        LOADER_REGS=LOADER_REGS, num_warps=HALF_WARPS)
    return out, lse2
