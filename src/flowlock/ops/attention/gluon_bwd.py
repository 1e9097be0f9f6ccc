"""Attention backward for Hopper in one pass, in Gluon: dQ, dK and dV from one read of Q, K, V, dO.

``attention_bwd_one_pass(q, k, v, dout, lse2, delta, scale)`` returns ``dq, dk, dv`` for bf16 / fp16
``(B, S, heads, 128)`` operands that :func:`flowlock.ops.attention.triton.tma_eligible` accepts, with
``lse2`` and ``delta`` ``(B, heads, S)`` fp32 (the forward's base-2 log-sum-exp and ``rowsum(dO * O)``).

Work: one program per (KV block of 128 rows, sample * head) walks the query blocks of 64 rows in
ascending order and issues five products per block pair: ``S^T = K Q^T``, ``dP^T = V dO^T``,
``dV += P^T dO``, ``dK += dS^T Q`` and the block's dQ term ``dS K`` (the separate Triton kernels issue
seven: their dQ kernel computes ``S`` and ``dP`` again). Partitions of a program:

* two compute warpgroups, each owning 64 of the KV rows (their dK, dV and dS). Both leave their dS in
  shared memory; each then computes half the columns of the block's dQ term as one chain over all 128
  KV rows from zero (warpgroup 0's rows first) and leaves it (fp32) in a shared slot;
* a loader warp: K and V once, then Q and dO blocks into a ring of stages both warpgroups release, with
  the query block's row statistics (``lse2``, ``delta``) beside them in shared memory;
* two fold warps, one a term slot (even and odd query blocks, so their waits for completed writes
  overlap): KV block 0 stores its terms as the fp32 dQ rows; a later KV block's term for query block
  ``m`` is added (TMA reduction) only when that block's turn counter says every earlier KV block's
  was, and the turn is passed on once the addition has completed. A small kernel then scales and
  rounds the fp32 rows into dQ.

Where a warpgroup stores its half of the term (``LATE_TERM``): 1 (in use) under the next query block's
S^T product, 0 right after the term's product. Measured on an H100 (c12df11, ad403c3, 8f93e79): at
1, 0.84-0.96 of the separate kernels' time (chained dQ) at S = 925-32768 with the best ticket grouping
(which follows the L2 footprint of the dQ rows, G x S x 128 x 4 bytes); 0 is 1-5% slower; FA3's
order (the term issued before dK and stored under it) ran at 0.93-1.01 and was removed. The row
statistics come staged by the loader, read from shared memory straight into the S^T tile's columns:
when the compute warpgroups loaded them themselves (a block ahead) and moved them into that layout
through shared memory, with warpgroup barriers around each move, the kernel took 1.11-1.20x this
time at S = 925-32768 (H100, one process; the old kernel from 2b679aa). The frozen sm90 configs run
this kernel at D = 128 with G = 2 (``flowlock.config``).

``diag`` (0 in use) switches parts off to see where the time goes, with wrong bits by design: 1 no
term store and no fold traffic, 3 the fold without turns, 4 the term stored but never sent to the TMA
unit, 5 passes the turn once the TMA unit has read the term (FA3's protocol; no guaranteed order)
(``benchmarks/one_pass_diagnostics.py``).

Bits (the contract of :mod:`flowlock.ops.attention.triton` for ``DQ_FOLD=1``): dK and dV are the
Triton dK/dV kernel's at its frozen tiles (64 query rows a step, the same products from the same
operands in the same order). dQ is the sum, in ascending KV-block order, of per-128-KV-row terms each
computed from zero (``P`` zero on KV rows past ``S``), starting from +0, each added by one IEEE fp32
addition (the TMA unit's ``.add.f32`` reduction keeps subnormals, as the GPU test with subnormal sums
shows; the first addition, in registers, is an ``add.rn.f32``), scaled and rounded once: what the
Triton dQ kernel computes with ``DQ_FOLD=1`` and 128-row KV blocks (:func:`flowlock.ops._dot.fold_add`).
The order is a constant
of the kernel: neither the batch, the head count, the token count's tiling, the ticket grouping nor the
SM count moves it.

Programs take their (KV block, sample * head) from a launch-wide ticket (see :mod:`flowlock.ops._turns`):
the program a turn waits for has always started.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from flowlock.ops._launch import fast_launch
from flowlock.ops.attention.gluon_operands import bshd_descriptor
from flowlock.ops.attention.reference import LOG2E

# Query rows a step, KV rows a program (two compute warpgroups of HALF_N rows each), head dim, Q / dO ring depth;
# the fp32 dQ term moves to global memory in column chunks of CHUNK (one 128-byte swizzle span: a TMA box).
BLOCK_M, BLOCK_N, HEAD_DIM, RING = 64, 128, 128, 2
HALF_N, CHUNK = BLOCK_N // 2, 32
# Warps and registers: compute warpgroups (the default partition and one worker), then the loader and fold warps.
COMPUTE_WARPS, COMPUTE_REGS, AGENT_REGS = 4, 240, 24
# Where the term is stored: 0 after its product, 1 under the next block's S^T product (the faster, c12df11).
LATE_TERM = 1


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """``global[coord box] += src`` by the TMA unit (``cp.reduce.async.bulk.tensor .add``, a bulk group
    like a TMA store; its fp32 additions keep subnormals). Triton 3.6 builds the op but gives Gluon no
    wrapper."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def _fold_add(acc, term):
    """``acc + term`` as one ``add.rn.f32``: :func:`flowlock.ops._dot.fold_add`, the Triton fold's
    addition, so the term's first store adds exactly as the separate kernels' fold does."""
    return gl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=r,r,r", [acc, term], dtype=gl.float32,
                                     is_pure=True, pack=1)


@gluon.jit
def _take_turn(turn, want):
    """Spin until ``*turn == want`` (acquire, GPU scope), then order the async proxy (the TMA reductions
    that follow) behind it; every lane polls."""
    return gl.inline_asm_elementwise(
        "{ .reg .pred not_yet; poll: ld.acquire.gpu.global.b32 $0, [$1]; setp.ne.s32 not_yet, $0, $2; "
        "@not_yet bra poll; fence.proxy.async.global; }",
        "=r,l,r", [turn, want], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _pass_turn(turn, value, DIAG: gl.constexpr):
    """``*turn = value`` once this warp's bulk stores and reductions have completed (not only read their
    source): wait for the bulk groups, join the lanes, order the async proxy's writes and every earlier
    write before a GPU-scope fence, then store. (``DIAG == 5``: after the read only, FA3's protocol; a
    diagnostic, its order is not guaranteed.)"""
    if DIAG == 5:
        return gl.inline_asm_elementwise(
            "cp.async.bulk.wait_group.read 0; bar.warp.sync -1; fence.acq_rel.gpu; "
            "st.relaxed.gpu.global.b32 [$1], $2; mov.b32 $0, 0;",
            "=r,l,r", [turn, value], dtype=gl.int32, is_pure=False, pack=1)
    else:
        return gl.inline_asm_elementwise(
            "cp.async.bulk.wait_group 0; bar.warp.sync -1; fence.proxy.async.global; fence.acq_rel.gpu; "
            "st.relaxed.gpu.global.b32 [$1], $2; mov.b32 $0, 0;",
            "=r,l,r", [turn, value], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _loader(q_desc, k_desc, v_desc, do_desc, q_bufs, do_bufs, k_smem, v_smem, stats_bufs, kv_ready, ready, empty,
            Lse2, Delta, pid_bh, seq, b, col, start_n, n_q, BLOCK_M: gl.constexpr, RING: gl.constexpr):
    mbarrier.expect(kv_ready, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [b, start_n, col], kv_ready, k_smem)
    tma.async_copy_global_to_shared(v_desc, [b, start_n, col], kv_ready, v_smem)
    offs = gl.arange(0, BLOCK_M, layout=gl.BlockedLayout([2], [32], [1], [0]))
    lse_base = Lse2 + pid_bh.to(gl.int64) * seq
    delta_base = Delta + pid_bh.to(gl.int64) * seq
    for m in range(n_q):
        s = m % RING
        # the query block's row statistics, loaded before the wait so the wait hides their latency; +inf
        # makes P exactly 0 on query rows past the sequence end
        rows = m * BLOCK_M + offs
        lse = gl.load(lse_base + rows, mask=rows < seq, other=float("inf"))
        delta = gl.load(delta_base + rows, mask=rows < seq, other=0.0)
        # a fresh barrier counts as having completed the phase before its first: parity 1 passes
        mbarrier.wait(empty.index(s), ((m // RING) & 1) ^ 1)
        stats_bufs.index(2 * s).store(lse)
        stats_bufs.index(2 * s + 1).store(delta)
        # every lane's stores land before the arrive below (one lane's), which releases them with the stage
        gl.thread_barrier()
        mbarrier.expect(ready.index(s), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, m * BLOCK_M, col], ready.index(s), q_bufs.index(s))
        tma.async_copy_global_to_shared(do_desc, [b, m * BLOCK_M, col], ready.index(s), do_bufs.index(s))


@gluon.jit
def _folder(acc_desc, term_bufs, term_full, term_free, turns, row0, kv_block, n_q,
            BLOCK_M: gl.constexpr, CHUNK: gl.constexpr, CHUNKS: gl.constexpr, DIAG: gl.constexpr,
            SLOT: gl.constexpr):
    """Query blocks ``m`` of term slot ``SLOT`` (``m % 2 == SLOT``; the other slot's blocks are another
    fold warp's, so the two wait for their writes' completion side by side): once the warpgroups have
    left the block's term in the slot, KV block 0 stores it as the fp32 dQ rows; a later KV block waits
    for its turn (every earlier KV block's term added) and adds its term by TMA reduction. The slot is
    handed back once read, the turn once the writes have completed. (``DIAG``: 3 adds without turns,
    4 sends nothing to the TMA unit, 5 passes turns once the TMA unit has read the term; diagnostics,
    wrong bits or no guaranteed order by design.)"""
    for m in range(SLOT, n_q, 2):
        mbarrier.wait(term_full.index(SLOT), (m // 2) & 1)
        buf = term_bufs.index(SLOT)
        if kv_block > 0:
            if DIAG != 3:
                _take_turn(turns + m, kv_block)
            if DIAG == 0 or DIAG == 3 or DIAG == 5:
                for c in gl.static_range(CHUNKS):
                    _tma_reduce_add(acc_desc, [row0 + m * BLOCK_M, c * CHUNK], buf.slice(c * CHUNK, CHUNK, dim=1))
        elif DIAG == 0 or DIAG == 3 or DIAG == 5:
            for c in gl.static_range(CHUNKS):
                tma.async_copy_shared_to_global(acc_desc, [row0 + m * BLOCK_M, c * CHUNK],
                                                buf.slice(c * CHUNK, CHUNK, dim=1))
        tma.store_wait(0)
        mbarrier.arrive(term_free.index(SLOT))
        _pass_turn(turns + m, kv_block + 1, DIAG)


@gluon.jit
def _leave_term(term_bufs, term_free, term_full, term, m, WG: gl.constexpr, HALF_D: gl.constexpr,
                DIAG: gl.constexpr):
    """Leave this warpgroup's half of query block ``m``'s term (fp32: the product from zero plus
    ``fold_start``, KV block 0's first fold addition) in term slot ``m % 2`` for its fold warp, once the
    fold warp has read the slot's previous term (a fresh barrier: parity 1 passes)."""
    slot = m % 2
    mbarrier.wait(term_free.index(slot), ((m // 2) & 1) ^ 1)
    if DIAG != 1:
        term_bufs.index(slot).slice(WG * HALF_D, HALF_D, dim=1).store(term)
        fence_async_shared()
    mbarrier.arrive(term_full.index(slot))


@gluon.jit
def _compute(q_bufs, do_bufs, k_smem, v_smem, ds_bufs, term_bufs, stats_bufs, kv_ready, ready, empty, ds_ready,
             term_full, term_free, dK, dV, b, h, start_n, seq, n_q, kv_block,
             qk_scale, sm_scale, stride_gb, stride_gs, stride_gh,
             WG: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
             HALF_N: gl.constexpr, RING: gl.constexpr, WARPS: gl.constexpr, DIAG: gl.constexpr,
             LATE: gl.constexpr):
    """KV rows ``start_n + WG * HALF_N ..``: their dK, dV and dS; and columns ``WG * D / 2 ..`` of the dQ
    term per query block: one chain over all 128 KV rows from zero, ``dS`` of warpgroup 0's rows ``@ K``
    of those rows, then warpgroup 1's, once both have left their ``dS`` in shared memory."""
    dtype: gl.constexpr = q_bufs.dtype
    HALF_D: gl.constexpr = D // 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                        instr_shape=[16, D, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                        instr_shape=[16, HALF_D, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)

    mbarrier.wait(kv_ready, 0)
    k_all = k_smem.reshape([BLOCK_N, D])
    k_wg = k_all.slice(WG * HALF_N, HALF_N, dim=0)
    v_wg = v_smem.reshape([BLOCK_N, D]).slice(WG * HALF_N, HALF_N, dim=0)
    k_cols0 = k_all.slice(0, HALF_N, dim=0).slice(WG * HALF_D, HALF_D, dim=1)
    k_cols1 = k_all.slice(HALF_N, HALF_N, dim=0).slice(WG * HALF_D, HALF_D, dim=1)
    kv_rows = start_n + WG * HALF_N + gl.arange(0, HALF_N, layout=gl.SliceLayout(1, s_layout))
    kv_ok = gl.expand_dims(kv_rows < seq, 1)
    cols_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    # KV block 0 starts the fold from zero (0 + term turns a -0 term into +0); adding -0 changes nothing
    fold_start = gl.where(kv_block == 0, 0.0, -0.0)
    zero_s = gl.zeros([HALF_N, BLOCK_M], gl.float32, layout=s_layout)
    zero_dq = gl.zeros([BLOCK_M, HALF_D], gl.float32, layout=dq_layout)
    dk = gl.zeros([HALF_N, D], gl.float32, layout=kv_layout)
    dv = gl.zeros([HALF_N, D], gl.float32, layout=kv_layout)
    # the last query block's term (LATE == 1 stores it while the next block's S^T product runs)
    prev = zero_dq
    for m in range(n_q):
        s = m % RING
        slot = m % 2
        phase = (m // 2) & 1
        mbarrier.wait(ready.index(s), (m // RING) & 1)
        # the row statistics the loader staged with Q and dO, read straight into the S^T tile's columns
        lse = stats_bufs.index(2 * s).load(cols_layout)
        delta = stats_bufs.index(2 * s + 1).load(cols_layout)
        q = q_bufs.index(s).reshape([BLOCK_M, D])
        do = do_bufs.index(s).reshape([BLOCK_M, D])
        st = warpgroup_mma(k_wg, q.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        if LATE == 1:
            if m > 0:
                _leave_term(term_bufs, term_free, term_full, prev, m - 1, WG, HALF_D, DIAG)
        dpt = warpgroup_mma(v_wg, do.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        st = warpgroup_mma_wait(1, deps=(st,))
        # KV rows past the sequence end: P = 0 (their dK / dV rows are not stored; dQ must not see them)
        pt = gl.where(kv_ok, gl.exp2(st * qk_scale - gl.expand_dims(lse, 0)), 0.0)
        # dV's product runs while dS is formed
        dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), a_layout), do, dv, is_async=True)
        dpt = warpgroup_mma_wait(1, deps=(dpt,))
        dst = (pt * (dpt - gl.expand_dims(delta, 0))).to(dtype)
        dk = warpgroup_mma(gl.convert_layout(dst, a_layout), q, dk, is_async=True)
        # dS of slot m % 2: the other warpgroup read this slot's previous dS before arriving at m - 1
        ds_bufs.index(2 * slot + WG).store(dst)
        fence_async_shared()
        mbarrier.arrive(ds_ready.index(slot))
        # the dQ term waits for dV and dK: their operands then leave registers for its accumulator
        dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
        mbarrier.arrive(empty.index(s))
        mbarrier.wait(ds_ready.index(slot), phase)
        term = warpgroup_mma(ds_bufs.index(2 * slot).permute((1, 0)), k_cols0, zero_dq, use_acc=False,
                             is_async=True)
        term = warpgroup_mma(ds_bufs.index(2 * slot + 1).permute((1, 0)), k_cols1, term, is_async=True)
        # KV block 0's addition is the fold's first. Made here, so the registers the term's store reads
        # (under the next S^T product) are the addition's: when the store read the product's own
        # registers, ptxas injected a wait for the products in flight before it (C7517), the S^T included.
        prev = _fold_add(fold_start, warpgroup_mma_wait(0, deps=(term,)))
        if LATE == 0:
            _leave_term(term_bufs, term_free, term_full, prev, m, WG, HALF_D, DIAG)
    if LATE == 1:
        _leave_term(term_bufs, term_free, term_full, prev, n_q - 1, WG, HALF_D, DIAG)

    rows = start_n + WG * HALF_N + gl.arange(0, HALF_N, layout=gl.SliceLayout(1, kv_layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, kv_layout))
    g_off = (b.to(gl.int64) * stride_gb + h.to(gl.int64) * stride_gh
             + gl.expand_dims(rows.to(gl.int64) * stride_gs, 1) + gl.expand_dims(cols, 0))
    ok = gl.expand_dims(rows < seq, 1)
    gl.store(dK + g_off, (dk * sm_scale).to(dtype), mask=ok)
    gl.store(dV + g_off, dv.to(dtype), mask=ok)


@gluon.jit
def _compute_second(q_bufs, do_bufs, k_smem, v_smem, ds_bufs, term_bufs, stats_bufs, kv_ready, ready, empty,
                    ds_ready, term_full, term_free, dK, dV, b, h, start_n, seq, n_q, kv_block,
                    qk_scale, sm_scale, stride_gb, stride_gs, stride_gh,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, HALF_N: gl.constexpr,
                    RING: gl.constexpr, WARPS: gl.constexpr, DIAG: gl.constexpr, LATE: gl.constexpr):
    _compute(q_bufs, do_bufs, k_smem, v_smem, ds_bufs, term_bufs, stats_bufs, kv_ready, ready, empty, ds_ready,
             term_full, term_free, dK, dV, b, h, start_n, seq, n_q, kv_block,
             qk_scale, sm_scale, stride_gb, stride_gs, stride_gh, 1, BLOCK_M, BLOCK_N, D, HALF_N, RING, WARPS, DIAG,
             LATE)


@fast_launch
@gluon.jit
def _attention_bwd_one_pass_kernel(q_desc, k_desc, v_desc, do_desc, acc_desc, Lse2, Delta, dK, dV, Turns,
                                   seq, heads, heads_total, kv_blocks, head_group, qk_scale, sm_scale,
                                   stride_gb, stride_gs, stride_gh,
                                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                                   HALF_N: gl.constexpr, CHUNK: gl.constexpr, RING: gl.constexpr,
                                   COMPUTE_REGS: gl.constexpr, AGENT_REGS: gl.constexpr, DIAG: gl.constexpr,
                                   LATE: gl.constexpr, num_warps: gl.constexpr):
    """One program per (KV block, sample * head) from the ticket ``Turns[0]``; ``Turns[1:]`` holds one
    turn counter per (sample * head, query block), zero at launch. ``acc_desc`` covers the fp32 dQ rows
    ``(sample * head * query blocks * BLOCK_M, D)`` in ``[BLOCK_M, CHUNK]`` boxes; they need no
    initial value (KV block 0 stores them before anyone adds)."""
    ticket = gl.atomic_add(Turns, 1, sem="relaxed", scope="gpu")
    group = ticket // (head_group * kv_blocks)
    first = group * head_group
    in_group = ticket - first * kv_blocks
    group_size = gl.minimum(head_group, heads_total - first)
    pid_n = in_group // group_size
    pid_bh = first + in_group % group_size
    b = pid_bh // heads
    h = pid_bh % heads
    start_n = pid_n * BLOCK_N
    n_q = gl.cdiv(seq, BLOCK_M)
    dtype: gl.constexpr = q_desc.dtype
    CHUNKS: gl.constexpr = D // CHUNK

    q_bufs = gl.allocate_shared_memory(dtype, [RING, 1, BLOCK_M, D], q_desc.layout)
    do_bufs = gl.allocate_shared_memory(dtype, [RING, 1, BLOCK_M, D], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_N, D], v_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF_N, BLOCK_M], dtype)
    ds_bufs = gl.allocate_shared_memory(dtype, [4, HALF_N, BLOCK_M], ds_layout)
    term_bufs = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, D], acc_desc.layout)
    # per ring stage: the query block's lse2 (2 * stage), then its delta
    stats_bufs = gl.allocate_shared_memory(gl.float32, [2 * RING, BLOCK_M],
                                           gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    term_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    term_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    for s in gl.static_range(RING):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)  # released by both compute warpgroups
    for s in gl.static_range(2):
        mbarrier.init(ds_ready.index(s), count=2)
        mbarrier.init(term_full.index(s), count=2)
        mbarrier.init(term_free.index(s), count=1)
    head_turns = Turns + 1 + pid_bh.to(gl.int64) * n_q
    head_rows = pid_bh * (n_q * BLOCK_M)
    # a fold warp for each term slot
    gl.warp_specialize([
        (_compute, (q_bufs, do_bufs, k_smem, v_smem, ds_bufs, term_bufs, stats_bufs, kv_ready, ready, empty,
                    ds_ready, term_full, term_free, dK, dV, b, h, start_n, seq, n_q, pid_n,
                    qk_scale, sm_scale, stride_gb, stride_gs, stride_gh, 0, BLOCK_M, BLOCK_N, D, HALF_N, RING,
                    num_warps, DIAG, LATE)),
        (_compute_second, (q_bufs, do_bufs, k_smem, v_smem, ds_bufs, term_bufs, stats_bufs, kv_ready, ready,
                           empty, ds_ready, term_full, term_free, dK, dV, b, h, start_n, seq,
                           n_q, pid_n, qk_scale, sm_scale, stride_gb, stride_gs, stride_gh, BLOCK_M, BLOCK_N, D,
                           HALF_N, RING, num_warps, DIAG, LATE)),
        (_loader, (q_desc, k_desc, v_desc, do_desc, q_bufs, do_bufs, k_smem, v_smem, stats_bufs, kv_ready, ready,
                   empty, Lse2, Delta, pid_bh, seq, b, h * D, start_n, n_q, BLOCK_M, RING)),
        (_folder, (acc_desc, term_bufs, term_full, term_free, head_turns, head_rows, pid_n, n_q, BLOCK_M, CHUNK,
                   CHUNKS, DIAG, 0)),
        (_folder, (acc_desc, term_bufs, term_full, term_free, head_turns, head_rows, pid_n, n_q, BLOCK_M, CHUNK,
                   CHUNKS, DIAG, 1)),
    ], [num_warps, 1, 1, 1], [COMPUTE_REGS, AGENT_REGS, AGENT_REGS, AGENT_REGS])


@triton.jit
def _dq_from_acc_kernel(Acc, dQ, seq, heads, n_rows, sm_scale, stride_gb, stride_gs, stride_gh,
                        BLOCK: tl.constexpr, D: tl.constexpr):
    """dQ rows ``[pid * BLOCK, ..)`` of one sample * head: the fp32 fold times the scale, rounded once."""
    pid_bh = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, D)
    acc = tl.load(Acc + (pid_bh.to(tl.int64) * n_rows + rows[:, None]) * D + cols[None, :], mask=(rows < seq)[:, None])
    b = pid_bh // heads
    h = pid_bh % heads
    out = dQ + b.to(tl.int64) * stride_gb + h.to(tl.int64) * stride_gh + rows[:, None].to(tl.int64) * stride_gs
    tl.store(out + cols[None, :], (acc * sm_scale).to(dQ.dtype.element_ty), mask=(rows < seq)[:, None])


def applies(q: torch.Tensor) -> bool:
    """Whether the kernel serves these operands (given that q, k, v, dO are all TMA-eligible): D = 128,
    bf16 / fp16."""
    return q.shape[3] == HEAD_DIM and q.dtype in (torch.bfloat16, torch.float16)


def attention_bwd_one_pass(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                           lse2: torch.Tensor, delta: torch.Tensor, scale: float, head_group: int,
                           diag: int = 0, late: int = LATE_TERM
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``dq, dk, dv`` (contiguous, like ``q``) for TMA-eligible bf16 / fp16 ``(B, S, heads, 128)``
    operands. Trusted inputs (:func:`flowlock.ops.attention.triton.attention_bwd` validated them).
    Programs take tickets in groups of ``head_group`` heads (sample * head), a group's KV blocks in
    turn, the head fastest: the programs running at once fold into the dQ rows of few heads (which then
    stay in L2) while each head's turn chain among them stays short. It orders the programs only: any
    value gives the same bits."""
    batch, seq, heads, dim = q.shape
    bh = batch * heads
    n_q = -(-seq // BLOCK_M)
    kv_blocks = -(-seq // BLOCK_N)
    dq = torch.empty((batch, seq, heads, dim), dtype=q.dtype, device=q.device)
    dk = torch.empty_like(dq)
    dv = torch.empty_like(dq)
    turns = torch.zeros(1 + bh * n_q, dtype=torch.int32, device=q.device)
    acc = torch.empty((bh * n_q * BLOCK_M, dim), dtype=torch.float32, device=q.device)
    acc_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_M, CHUNK], gl.float32)
    acc_desc = TensorDescriptor(acc, list(acc.shape), list(acc.stride()), [BLOCK_M, CHUNK], acc_layout)
    _attention_bwd_one_pass_kernel[(kv_blocks * bh,)](
        bshd_descriptor(q, BLOCK_M), bshd_descriptor(k, BLOCK_N), bshd_descriptor(v, BLOCK_N),
        bshd_descriptor(dout, BLOCK_M),
        acc_desc, lse2, delta, dk, dv, turns, seq, heads, bh, kv_blocks, head_group, scale * LOG2E, scale,
        *dq.stride()[:3],
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, D=HEAD_DIM, HALF_N=HALF_N, CHUNK=CHUNK, RING=RING,
        COMPUTE_REGS=COMPUTE_REGS, AGENT_REGS=AGENT_REGS, DIAG=diag, LATE=late,
        num_warps=COMPUTE_WARPS)
    _dq_from_acc_kernel[(n_q, bh)](acc, dq, seq, heads, n_q * BLOCK_M, scale, *dq.stride()[:3],
                                   BLOCK=BLOCK_M, D=dim, num_warps=4)
    return dq, dk, dv
