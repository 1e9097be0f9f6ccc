"""Attention forward for Hopper in Gluon: each warpgroup's softmax under its own and the other's products.

``attention_fwd_ws(q, k, v, scale)`` computes what the Triton forward of
:mod:`flowlock.ops.attention.triton` computes under its frozen bf16 / fp16 sm90 config (128 query rows
a program, KV blocks of 128, D = 128), with the same values in the same order. Partitions of a program:

* two warpgroups, one per 64-row half of the query block (the Triton kernel's 8 warps, m64 n128 k16,
  each warp 16 rows). Each issues KV block ``j + 1``'s scores product before block ``j``'s ``P @ V``
  and runs block ``j + 1``'s softmax while that ``P @ V`` is in flight (FA3's intra-warpgroup overlap;
  the Triton kernel waits for each product before the next step). With ``pingpong`` the two halves
  take turns issuing their products (two 256-thread hardware barriers), so one half's products run
  under the other's softmax (FA3's ping-pong); without it the warp schedulers interleave them;
* a producer warp: the query halves once, then K and V into a ring of ``ring`` stages both halves
  release.

Bits: a row's operations are the Triton kernel's on the same per-warp layout, so the row maxima and
sums reduce in the same tree: scores from zero over D, the last partial KV block's columns past
``seq`` set to -inf, the running maximum of the scaled scores, ``P = exp2(s * scale' - m)`` rounded to
the input dtype, the accumulator rescaled by ``exp2(m_old - m)`` once the previous ``P @ V`` has landed
and then ``P @ V`` onto it, the row sum folded as ``l * alpha + sum(P)``, one division and one rounding
of O, ``lse2 = m + log2(l)``. Reordering the issue changes no operand and no order of additions. GPU
test: ``tests/ops/test_attention_gluon_fwd_gpu.py`` (bitwise against the Triton forward).

Measured on an H100 (two runs, ``bench_attention.py --sections gluon_fwd``): three stages run
0.84-0.92 of the Triton forward's time at S = 925-32768, with or without ping-pong; two stages (the
producer a block behind) 1.10-1.30. An earlier version with the halves apart but each half waiting for
its products (73c17e3) ran 1.006-1.020 of the Triton forward on an H200.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from flowlock.ops._launch import fast_launch
from flowlock.ops.attention.gluon_operands import bshd_descriptor
from flowlock.ops.attention.reference import LOG2E

# Query rows of a program (two halves of 64, one per partition), KV rows of a block, head dim.
BLOCK_M, BLOCK_N, HEAD_DIM = 128, 128, 128
HALF = BLOCK_M // 2
# The second half's partition (one warpgroup) and the producer (one warp): warps and registers.
HALF_WARPS, HALF_REGS, LOADER_WARPS, LOADER_REGS = 4, 240, 1, 24
# The frozen schedule (fee6cf2, two H100 runs): three KV stages (two left the producer a block behind,
# 1.10-1.30x the Triton forward) and ping-pong (0.985-0.999 of cuDNN at S = 32768 against 1.017-1.038
# without it; within 1% of it at S = 4253 / 16384 and 1.5% behind at 925).
RING, PINGPONG = 3, True


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
def _named_barrier(bar, ARRIVE: gl.constexpr):
    """Both halves' 256 threads meet at hardware barrier ``bar``: this warpgroup waits for it (``bar.sync``)
    or only counts itself in (``bar.arrive``). Ids 14 and 15 lie above those Triton gives its partitions."""
    if ARRIVE:
        return gl.inline_asm_elementwise("bar.arrive $1, 256; mov.b32 $0, 0;", "=r,r", [bar], dtype=gl.int32,
                                         is_pure=False, pack=1)
    else:
        return gl.inline_asm_elementwise("bar.sync $1, 256; mov.b32 $0, 0;", "=r,r", [bar], dtype=gl.int32,
                                         is_pure=False, pack=1)


@gluon.jit
def _softmax(qk, m_i, l_i, start_n, seq, qk_scale, layout: gl.constexpr):
    """One KV block's online-softmax step on its scores ``qk`` (fp32, ``[rows, BLOCK_N]``): the columns
    past ``seq`` set to -inf, then ``(p, alpha, m_new, l_new)`` as the Triton forward computes them."""
    BLOCK_N: gl.constexpr = qk.shape[1]
    if start_n + BLOCK_N > seq:
        cols = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        qk = gl.where(gl.expand_dims(cols < seq, 0), qk, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(qk, 1) * qk_scale)
    p = gl.exp2(qk * qk_scale - gl.expand_dims(m_new, 1))
    alpha = gl.exp2(m_i - m_new)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def _half(q_bufs, k_bufs, v_bufs, q_ready, ready, empty, Out, Lse2, b, h, pid_bh, start_m, seq, n_kv, qk_scale,
          stride_ob, stride_os, stride_oh, C: gl.constexpr, HALF: gl.constexpr, BLOCK_N: gl.constexpr,
          D: gl.constexpr, RING: gl.constexpr, WARPS: gl.constexpr, PINGPONG: gl.constexpr):
    """Query rows ``start_m + C * HALF ..`` of one (sample, head): the online softmax over the KV ring.
    Block ``j + 1``'s scores product is issued before block ``j``'s ``P @ V``, and block ``j + 1``'s
    softmax runs while that ``P @ V`` is in flight (FA3's intra-warpgroup overlap); each block's
    accumulator is rescaled once its ``P @ V`` has landed, before the next one is issued."""
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                     instr_shape=[16, BLOCK_N, 16])
    rows_layout: gl.constexpr = gl.SliceLayout(1, layout)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=layout, k_width=2)
    dtype: gl.constexpr = q_bufs.dtype
    zero = gl.zeros([HALF, BLOCK_N], gl.float32, layout=layout)
    mbarrier.wait(q_ready.index(C), 0)
    q = q_bufs.index(C).reshape([HALF, D])
    m_i = gl.full([HALF], float("-inf"), gl.float32, layout=rows_layout)
    l_i = gl.zeros([HALF], gl.float32, layout=rows_layout)
    acc = gl.zeros([HALF, D], gl.float32, layout=layout)
    mbarrier.wait(ready.index(0), 0)
    qk = warpgroup_mma(q, k_bufs.index(0).reshape([BLOCK_N, D]).permute((1, 0)), zero, use_acc=False,
                       is_async=True)
    qk = warpgroup_mma_wait(0, deps=(qk,))
    p, alpha, m_i, l_i = _softmax(qk, m_i, l_i, 0, seq, qk_scale, layout)
    acc = acc * gl.expand_dims(alpha, 1)
    if PINGPONG and C == 1:
        _named_barrier(14, True)
    for j in range(n_kv - 1):
        s = j % RING
        nxt = (j + 1) % RING
        mbarrier.wait(ready.index(nxt), ((j + 1) // RING) & 1)
        if PINGPONG:
            _named_barrier(14 + C, False)
        qk = warpgroup_mma(q, k_bufs.index(nxt).reshape([BLOCK_N, D]).permute((1, 0)), zero, use_acc=False,
                           is_async=True)
        acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_bufs.index(s).reshape([BLOCK_N, D]), acc,
                            is_async=True)
        if PINGPONG:
            _named_barrier(15 - C, True)
        qk = warpgroup_mma_wait(1, deps=(qk,))
        p, alpha, m_i, l_i = _softmax(qk, m_i, l_i, (j + 1) * BLOCK_N, seq, qk_scale, layout)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index(s))
        acc = acc * gl.expand_dims(alpha, 1)
    last = (n_kv - 1) % RING
    if PINGPONG:
        _named_barrier(14 + C, False)
    acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_bufs.index(last).reshape([BLOCK_N, D]), acc,
                        is_async=True)
    if PINGPONG and C == 0:
        _named_barrier(15, True)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    mbarrier.arrive(empty.index(last))
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
              RING: gl.constexpr, WARPS: gl.constexpr, PINGPONG: gl.constexpr):
    _half(q_bufs, k_bufs, v_bufs, q_ready, ready, empty, Out, Lse2, b, h, pid_bh, start_m, seq, n_kv, qk_scale,
          stride_ob, stride_os, stride_oh, 1, HALF, BLOCK_N, D, RING, WARPS, PINGPONG)


@fast_launch
@gluon.jit
def _attention_fwd_ws_kernel(q_desc, k_desc, v_desc, Out, Lse2, seq, heads, qk_scale, stride_ob, stride_os, stride_oh,
                             HALF: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, RING: gl.constexpr,
                             HALF_WARPS: gl.constexpr, HALF_REGS: gl.constexpr, LOADER_WARPS: gl.constexpr,
                             LOADER_REGS: gl.constexpr, PINGPONG: gl.constexpr, num_warps: gl.constexpr):
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
                 stride_ob, stride_os, stride_oh, 0, HALF, BLOCK_N, D, RING, num_warps, PINGPONG)),
        (_half_one, (q_bufs, k_bufs, v_bufs, q_ready, ready, empty, Out, Lse2, b, h, pid_bh, start_m, seq, n_kv,
                     qk_scale, stride_ob, stride_os, stride_oh, HALF, BLOCK_N, D, RING, HALF_WARPS, PINGPONG)),
        (_loader, (q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, ready, empty, b, col, start_m, n_kv, HALF,
                   BLOCK_N, RING)),
    ], [HALF_WARPS, LOADER_WARPS], [HALF_REGS, LOADER_REGS])


def descriptors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[TensorDescriptor, ...]:
    """The kernel's q, k, v descriptors (operands ``tma_eligible`` in :mod:`flowlock.ops.attention.triton`)."""
    return bshd_descriptor(q, HALF), bshd_descriptor(k, BLOCK_N), bshd_descriptor(v, BLOCK_N)


def applies(q: torch.Tensor) -> bool:
    """Whether the kernel serves these operands (given that q, k, v are all TMA-eligible): D = 128,
    bf16 / fp16."""
    return q.shape[3] == HEAD_DIM and q.dtype in (torch.bfloat16, torch.float16)


def attention_fwd_ws(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, ring: int = RING,
                     pingpong: bool = PINGPONG) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out (B, S, heads, D) contiguous, lse2 (B, heads, S) fp32)`` for bf16 / fp16 ``(B, S, heads, 128)``
    operands that the Triton forward reads through descriptors, on ``ring`` KV stages, the halves'
    products in turns when ``pingpong``. Any ``ring`` >= 2 and either ``pingpong`` give the same bits."""
    batch, seq, heads, dim = q.shape
    if not applies(q):
        raise ValueError(f"the Gluon attention forward serves D = {HEAD_DIM} in bf16 / fp16, got D = {dim}, {q.dtype}")
    out = torch.empty((batch, seq, heads, dim), dtype=q.dtype, device=q.device)
    lse2 = torch.empty((batch, heads, seq), dtype=torch.float32, device=q.device)
    _attention_fwd_ws_kernel[(triton.cdiv(seq, BLOCK_M), batch * heads)](
        *descriptors(q, k, v), out, lse2, seq, heads, scale * LOG2E, *out.stride()[:3], HALF=HALF, BLOCK_N=BLOCK_N,
        D=HEAD_DIM, RING=ring, HALF_WARPS=HALF_WARPS, HALF_REGS=HALF_REGS, LOADER_WARPS=LOADER_WARPS,
        LOADER_REGS=LOADER_REGS, PINGPONG=pingpong, num_warps=HALF_WARPS)
    return out, lse2
