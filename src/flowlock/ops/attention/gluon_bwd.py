"""Attention backward for Hopper in one pass, in Gluon: dQ, dK and dV from one read of Q, K, V, dO.

``attention_bwd_one_pass(q, k, v, dout, lse2, delta, scale)`` returns ``dq, dk, dv`` for bf16 / fp16
``(B, S, heads, 128)`` operands that :func:`flowlock.ops.attention.triton.tma_eligible` accepts, with
``lse2`` and ``delta`` ``(B, heads, S)`` fp32 (the forward's base-2 log-sum-exp and ``rowsum(dO * O)``).

Work: one program per (KV block of 128 rows, sample * head) walks the query blocks of 64 rows in
ascending order and issues five products per block pair: ``S^T = K Q^T``, ``dP^T = V dO^T``,
``dV += P^T dO``, ``dK += dS^T Q`` and the block's dQ term ``dS K`` (the separate Triton kernels issue
seven: their dQ kernel computes ``S`` and ``dP`` again). Partitions of a program:

* two compute warpgroups, each owning 64 of the KV rows (their dK and dV) and, for the dQ term, 64 of
  the head's 128 columns over all 128 KV rows; they share ``dS^T`` through shared memory;
* a loader warp: K and V once, then Q and dO blocks into a ring of stages both warpgroups release;
* a turn warp: the dQ term of query block ``m`` may be added to the fp32 dQ rows only after every
  earlier KV block's term was (turn counter ``(sample * head, m)``); it waits for the turn, tells the
  warpgroups, and after both have stored their sums hands the turn to the next KV block.

The compute warpgroups load the dQ rows once the turn is theirs, early in the block, and store the sum
at its end, so no product waits on another program; only a turn that has not arrived stalls them.

Bits (the contract of :mod:`flowlock.ops.attention.triton` for ``DQ_FOLD=1``): dK and dV are the
Triton dK/dV kernel's at its frozen tiles (64 query rows a step, the same products from the same
operands in the same order). dQ is the sum, in ascending KV-block order, of per-128-KV-row terms each
computed from zero (``P`` zero on KV rows past ``S``), starting from zero, scaled and rounded once:
what the Triton dQ kernel computes with ``DQ_FOLD=1`` and 128-row KV blocks. The order is a constant
of the kernel: neither the batch, the head count, the token count's tiling nor the SM count moves it.

Programs take their (KV block, sample * head) from a launch-wide ticket, the sample * head index
fastest (see :mod:`flowlock.ops._turns`): the program a turn waits for has always started.
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

# Query rows a step, KV rows a program (two compute warpgroups of HALF_N), head dim, Q / dO ring depth;
# the dQ rows move in column chunks of CHUNK fp32 (one 128-byte swizzle span: a TMA box and a wgmma N).
BLOCK_M, BLOCK_N, HEAD_DIM, RING = 64, 128, 128, 2
HALF_N, CHUNK = BLOCK_N // 2, 32
# Warps and registers: compute warpgroups (the default partition and one worker), loader and turn warps.
COMPUTE_WARPS, COMPUTE_REGS, AGENT_WARPS, AGENT_REGS = 4, 224, 1, 24


@gluon.jit
def _take_turn(turn, want):
    """Spin until ``*turn == want`` (acquire, GPU scope), then order the async proxy (the TMA loads
    that follow) behind it; every lane polls. Returns the value read."""
    return gl.inline_asm_elementwise(
        "{ .reg .pred not_yet; poll: ld.acquire.gpu.global.b32 $0, [$1]; setp.ne.s32 not_yet, $0, $2; "
        "@not_yet bra poll; fence.proxy.async.global; }",
        "=r,l,r", [turn, want], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _pass_turn(turn, value):
    """``*turn = value`` once this warp's TMA stores have completed (not only read their source):
    wait for the bulk groups, join the warp's lanes, order the async proxy's writes and every
    earlier store before a GPU-scope fence, then store."""
    return gl.inline_asm_elementwise(
        "cp.async.bulk.wait_group 0; bar.warp.sync -1; fence.proxy.async.global; fence.acq_rel.gpu; "
        "st.relaxed.gpu.global.b32 [$1], $2; mov.b32 $0, 0;",
        "=r,l,r", [turn, value], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _loader(q_desc, k_desc, v_desc, do_desc, q_bufs, do_bufs, k_smem, v_smem, kv_ready, ready, empty,
            b, col, start_n, n_q, BLOCK_M: gl.constexpr, RING: gl.constexpr):
    mbarrier.expect(kv_ready, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [b, start_n, col], kv_ready, k_smem)
    tma.async_copy_global_to_shared(v_desc, [b, start_n, col], kv_ready, v_smem)
    for m in range(n_q):
        s = m % RING
        # a fresh barrier counts as having completed the phase before its first: parity 1 passes
        mbarrier.wait(empty.index(s), ((m // RING) & 1) ^ 1)
        mbarrier.expect(ready.index(s), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, m * BLOCK_M, col], ready.index(s), q_bufs.index(s))
        tma.async_copy_global_to_shared(do_desc, [b, m * BLOCK_M, col], ready.index(s), do_bufs.index(s))


@gluon.jit
def _turn_agent(acc_desc, acc_bufs, acc_ready, acc_done, turns, row0, kv_block, last_kv, n_q,
                BLOCK_M: gl.constexpr, CHUNK: gl.constexpr, CHUNKS: gl.constexpr):
    """Per query block ``m``: take the turn (KV block 0 holds every turn from the start and loads
    nothing: the warpgroups start from zero), TMA-load the fp32 dQ rows into slot ``m % 2``; then,
    once both warpgroups have written their sums back into the slot, store them and pass the turn
    to the next KV block (the last KV block wrote dQ itself and keeps it)."""
    for m in range(n_q):
        slot = m % 2
        if kv_block > 0:
            _take_turn(turns + m, kv_block)
            mbarrier.expect(acc_ready.index(slot), CHUNKS * acc_desc.block_type.nbytes)
            for c in gl.static_range(CHUNKS):
                tma.async_copy_global_to_shared(acc_desc, [row0 + m * BLOCK_M, c * CHUNK], acc_ready.index(slot),
                                                acc_bufs.index(slot * CHUNKS + c))
        else:
            mbarrier.arrive(acc_ready.index(slot))
        if m > 0:
            _finish(acc_desc, acc_bufs, acc_done, turns, row0, kv_block, last_kv, m - 1, BLOCK_M, CHUNK, CHUNKS)
    _finish(acc_desc, acc_bufs, acc_done, turns, row0, kv_block, last_kv, n_q - 1, BLOCK_M, CHUNK, CHUNKS)


@gluon.jit
def _finish(acc_desc, acc_bufs, acc_done, turns, row0, kv_block, last_kv, m, BLOCK_M: gl.constexpr,
            CHUNK: gl.constexpr, CHUNKS: gl.constexpr):
    slot = m % 2
    mbarrier.wait(acc_done.index(slot), (m // 2) & 1)
    if kv_block != last_kv:
        for c in gl.static_range(CHUNKS):
            tma.async_copy_shared_to_global(acc_desc, [row0 + m * BLOCK_M, c * CHUNK],
                                            acc_bufs.index(slot * CHUNKS + c))
        _pass_turn(turns + m, kv_block + 1)


@gluon.jit
def _add_term(buf, part, dQ, b, h, start_m, col0, seq, kv_block, last_kv, sm_scale, stride_gb, stride_gs, stride_gh,
              layout: gl.constexpr, BLOCK_M: gl.constexpr, CHUNK: gl.constexpr):
    """``buf`` (the fp32 dQ rows of one column chunk; ignored on KV block 0, which starts from zero)
    plus this KV block's ``part``: back into ``buf``, or scaled, rounded and stored as dQ on the last."""
    total = gl.where(kv_block > 0, buf.load(layout), 0.0) + part
    if kv_block == last_kv:
        rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
        cols = col0 + gl.arange(0, CHUNK, layout=gl.SliceLayout(0, layout))
        ptrs = (dQ + b.to(gl.int64) * stride_gb + h.to(gl.int64) * stride_gh
                + gl.expand_dims(rows.to(gl.int64) * stride_gs, 1) + gl.expand_dims(cols, 0))
        gl.store(ptrs, (total * sm_scale).to(dQ.dtype.element_ty), mask=gl.expand_dims(rows < seq, 1))
    else:
        buf.store(total)


@gluon.jit
def _compute(q_bufs, do_bufs, k_smem, v_smem, ds_bufs, acc_bufs, kv_ready, ready, empty, ds_ready, acc_ready,
             acc_done, Lse2, Delta, dQ, dK, dV, b, h, pid_bh, start_n, seq, n_q, kv_block, last_kv,
             qk_scale, sm_scale, stride_gb, stride_gs, stride_gh,
             WG: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
             HALF_N: gl.constexpr, CHUNK: gl.constexpr, CHUNKS: gl.constexpr, RING: gl.constexpr,
             WARPS: gl.constexpr):
    """KV rows ``start_n + WG * HALF_N ..`` (their dK, dV) and the dQ column chunks ``2 * WG`` and
    ``2 * WG + 1`` (half the head: ``CHUNKS`` is 4)."""
    dtype: gl.constexpr = q_bufs.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                        instr_shape=[16, D, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                        instr_shape=[16, CHUNK, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)

    mbarrier.wait(kv_ready, 0)
    k_all = k_smem.reshape([BLOCK_N, D])
    v_all = v_smem.reshape([BLOCK_N, D])
    k_wg = k_all.slice(WG * HALF_N, HALF_N, dim=0)
    v_wg = v_all.slice(WG * HALF_N, HALF_N, dim=0)

    kv_rows = start_n + WG * HALF_N + gl.arange(0, HALF_N, layout=gl.SliceLayout(1, s_layout))
    kv_ok = gl.expand_dims(kv_rows < seq, 1)
    cols_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    q_offs = gl.arange(0, BLOCK_M, layout=gl.BlockedLayout([1], [32], [WARPS], [0]))
    lse_base = Lse2 + pid_bh.to(gl.int64) * seq
    delta_base = Delta + pid_bh.to(gl.int64) * seq
    zero_s = gl.zeros([HALF_N, BLOCK_M], gl.float32, layout=s_layout)
    zero_dq = gl.zeros([BLOCK_M, CHUNK], gl.float32, layout=dq_layout)
    dk = gl.zeros([HALF_N, D], gl.float32, layout=kv_layout)
    dv = gl.zeros([HALF_N, D], gl.float32, layout=kv_layout)
    for m in range(n_q):
        s = m % RING
        start_m = m * BLOCK_M
        # one value a thread, then spread to the columns of the S^T tile (a per-column load would hold
        # a 64-bit address for each of a thread's columns); +inf makes P exactly 0 on query rows past
        # the sequence end
        q_rows = start_m + q_offs
        lse = gl.convert_layout(gl.load(lse_base + q_rows, mask=q_rows < seq, other=float("inf")), cols_layout)
        delta = gl.convert_layout(gl.load(delta_base + q_rows, mask=q_rows < seq, other=0.0), cols_layout)
        mbarrier.wait(ready.index(s), (m // RING) & 1)
        q = q_bufs.index(s).reshape([BLOCK_M, D])
        do = do_bufs.index(s).reshape([BLOCK_M, D])
        st = warpgroup_mma(k_wg, q.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dpt = warpgroup_mma(v_wg, do.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        st = warpgroup_mma_wait(1, deps=(st,))
        # KV rows past the sequence end: P = 0 (their dK / dV rows are not stored; dQ must not see them)
        pt = gl.where(kv_ok, gl.exp2(st * qk_scale - gl.expand_dims(lse, 0)), 0.0)
        # dV's product runs while dS is formed
        dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), a_layout), do, dv, is_async=True)
        dpt = warpgroup_mma_wait(1, deps=(dpt,))
        dst = (pt * (dpt - gl.expand_dims(delta, 0))).to(dtype)
        dk = warpgroup_mma(gl.convert_layout(dst, a_layout), q, dk, is_async=True)
        ds_smem = ds_bufs.index(m % 2)
        ds_smem.slice(WG * HALF_N, HALF_N, dim=0).store(dst)
        fence_async_shared()
        mbarrier.arrive(ds_ready.index(m % 2))
        dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
        mbarrier.arrive(empty.index(s))
        mbarrier.wait(ds_ready.index(m % 2), (m // 2) & 1)
        # this block's dQ term over all BLOCK_N KV rows, for this warpgroup's two column chunks, from zero
        ds_all = ds_smem.permute((1, 0))
        part0 = warpgroup_mma(ds_all, k_all.slice((2 * WG) * CHUNK, CHUNK, dim=1), zero_dq, use_acc=False,
                              is_async=True)
        part1 = warpgroup_mma(ds_all, k_all.slice((2 * WG + 1) * CHUNK, CHUNK, dim=1), zero_dq, use_acc=False,
                              is_async=True)
        part0, part1 = warpgroup_mma_wait(0, deps=(part0, part1))
        # the fp32 dQ rows of this query block (the agent loaded them once the turn was ours; KV
        # block 0 starts from zero), plus the term: written back for the agent to store, or, on
        # the last KV block, scaled, rounded and stored as dQ
        slot = m % 2
        mbarrier.wait(acc_ready.index(slot), (m // 2) & 1)
        _add_term(acc_bufs.index(slot * CHUNKS + 2 * WG), part0, dQ, b, h, start_m, (2 * WG) * CHUNK, seq,
                  kv_block, last_kv, sm_scale, stride_gb, stride_gs, stride_gh, dq_layout, BLOCK_M, CHUNK)
        _add_term(acc_bufs.index(slot * CHUNKS + 2 * WG + 1), part1, dQ, b, h, start_m, (2 * WG + 1) * CHUNK, seq,
                  kv_block, last_kv, sm_scale, stride_gb, stride_gs, stride_gh, dq_layout, BLOCK_M, CHUNK)
        fence_async_shared()
        mbarrier.arrive(acc_done.index(slot))

    rows = start_n + WG * HALF_N + gl.arange(0, HALF_N, layout=gl.SliceLayout(1, kv_layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, kv_layout))
    g_off = (b.to(gl.int64) * stride_gb + h.to(gl.int64) * stride_gh
             + gl.expand_dims(rows.to(gl.int64) * stride_gs, 1) + gl.expand_dims(cols, 0))
    ok = gl.expand_dims(rows < seq, 1)
    gl.store(dK + g_off, (dk * sm_scale).to(dtype), mask=ok)
    gl.store(dV + g_off, dv.to(dtype), mask=ok)


@gluon.jit
def _compute_second(q_bufs, do_bufs, k_smem, v_smem, ds_bufs, acc_bufs, kv_ready, ready, empty, ds_ready, acc_ready,
                    acc_done, Lse2, Delta, dQ, dK, dV, b, h, pid_bh, start_n, seq, n_q, kv_block, last_kv,
                    qk_scale, sm_scale, stride_gb, stride_gs, stride_gh,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, HALF_N: gl.constexpr,
                    CHUNK: gl.constexpr, CHUNKS: gl.constexpr, RING: gl.constexpr, WARPS: gl.constexpr):
    _compute(q_bufs, do_bufs, k_smem, v_smem, ds_bufs, acc_bufs, kv_ready, ready, empty, ds_ready, acc_ready,
             acc_done, Lse2, Delta, dQ, dK, dV, b, h, pid_bh, start_n, seq, n_q, kv_block, last_kv,
             qk_scale, sm_scale, stride_gb, stride_gs, stride_gh, 1, BLOCK_M, BLOCK_N, D, HALF_N, CHUNK, CHUNKS,
             RING, WARPS)


@fast_launch
@gluon.jit
def _attention_bwd_one_pass_kernel(q_desc, k_desc, v_desc, do_desc, acc_desc, Lse2, Delta, dQ, dK, dV, Turns,
                                   seq, heads, heads_total, kv_blocks, qk_scale, sm_scale,
                                   stride_gb, stride_gs, stride_gh,
                                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                                   HALF_N: gl.constexpr, CHUNK: gl.constexpr, RING: gl.constexpr,
                                   COMPUTE_REGS: gl.constexpr, AGENT_REGS: gl.constexpr, num_warps: gl.constexpr):
    """One program per (KV block, sample * head) from the ticket ``Turns[0]``; ``Turns[1:]`` holds one
    turn counter per (sample * head, query block), zero at launch. ``acc_desc`` covers the fp32 dQ rows
    ``(sample * head * query blocks * BLOCK_M, D)`` in ``[BLOCK_M, CHUNK]`` boxes; they need no
    initial value (KV block 0 writes them before anyone reads them)."""
    ticket = gl.atomic_add(Turns, 1, sem="relaxed", scope="gpu")
    pid_n = ticket // heads_total
    pid_bh = ticket % heads_total
    b = pid_bh // heads
    h = pid_bh % heads
    col = h * D
    start_n = pid_n * BLOCK_N
    n_q = gl.cdiv(seq, BLOCK_M)
    last_kv = kv_blocks - 1
    turns = Turns + 1 + pid_bh.to(gl.int64) * n_q
    row0 = pid_bh * (n_q * BLOCK_M)
    dtype: gl.constexpr = q_desc.dtype
    CHUNKS: gl.constexpr = D // CHUNK

    q_bufs = gl.allocate_shared_memory(dtype, [RING, 1, BLOCK_M, D], q_desc.layout)
    do_bufs = gl.allocate_shared_memory(dtype, [RING, 1, BLOCK_M, D], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_N, D], v_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    ds_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
    acc_bufs = gl.allocate_shared_memory(gl.float32, [2 * CHUNKS, BLOCK_M, CHUNK], acc_desc.layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    acc_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    acc_done = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    for s in gl.static_range(RING):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)  # released by both compute warpgroups
    for s in gl.static_range(2):
        mbarrier.init(ds_ready.index(s), count=2)
        mbarrier.init(acc_ready.index(s), count=1)
        mbarrier.init(acc_done.index(s), count=2)
    gl.warp_specialize([
        (_compute, (q_bufs, do_bufs, k_smem, v_smem, ds_bufs, acc_bufs, kv_ready, ready, empty, ds_ready, acc_ready,
                    acc_done, Lse2, Delta, dQ, dK, dV, b, h, pid_bh, start_n, seq, n_q, pid_n, last_kv,
                    qk_scale, sm_scale, stride_gb, stride_gs, stride_gh,
                    0, BLOCK_M, BLOCK_N, D, HALF_N, CHUNK, CHUNKS, RING, num_warps)),
        (_compute_second, (q_bufs, do_bufs, k_smem, v_smem, ds_bufs, acc_bufs, kv_ready, ready, empty, ds_ready,
                           acc_ready, acc_done, Lse2, Delta, dQ, dK, dV, b, h, pid_bh, start_n, seq, n_q, pid_n,
                           last_kv, qk_scale, sm_scale, stride_gb, stride_gs, stride_gh,
                           BLOCK_M, BLOCK_N, D, HALF_N, CHUNK, CHUNKS, RING, num_warps)),
        (_loader, (q_desc, k_desc, v_desc, do_desc, q_bufs, do_bufs, k_smem, v_smem, kv_ready, ready, empty,
                   b, col, start_n, n_q, BLOCK_M, RING)),
        (_turn_agent, (acc_desc, acc_bufs, acc_ready, acc_done, turns, row0, pid_n, last_kv, n_q,
                       BLOCK_M, CHUNK, CHUNKS)),
    ], [num_warps, 1, 1], [COMPUTE_REGS, AGENT_REGS, AGENT_REGS])


def applies(q: torch.Tensor) -> bool:
    """Whether the kernel serves these operands (given that q, k, v, dO are all TMA-eligible): D = 128,
    bf16 / fp16."""
    return q.shape[3] == HEAD_DIM and q.dtype in (torch.bfloat16, torch.float16)


def _descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    batch, seq, heads, dim = t.shape
    dt = gl.bfloat16 if t.dtype == torch.bfloat16 else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for([1, rows, dim], dt)
    return TensorDescriptor(t, [batch, seq, heads * dim], [t.stride(0), t.stride(1), 1], [1, rows, dim], layout)


def attention_bwd_one_pass(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                           lse2: torch.Tensor, delta: torch.Tensor,
                           scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``dq, dk, dv`` (contiguous, like ``q``) for TMA-eligible bf16 / fp16 ``(B, S, heads, 128)``
    operands. Trusted inputs (:func:`flowlock.ops.attention.triton.attention_bwd` validated them)."""
    batch, seq, heads, dim = q.shape
    bh = batch * heads
    n_q = -(-seq // BLOCK_M)
    kv_blocks = -(-seq // BLOCK_N)
    dq = torch.empty((batch, seq, heads, dim), dtype=q.dtype, device=q.device)
    dk = torch.empty_like(dq)
    dv = torch.empty_like(dq)
    turns = torch.zeros(1 + bh * n_q, dtype=torch.int32, device=q.device)
    dq_acc = torch.empty((bh * n_q * BLOCK_M, dim), dtype=torch.float32, device=q.device)
    acc_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_M, CHUNK], gl.float32)
    acc_desc = TensorDescriptor(dq_acc, list(dq_acc.shape), list(dq_acc.stride()), [BLOCK_M, CHUNK], acc_layout)
    _attention_bwd_one_pass_kernel[(kv_blocks * bh,)](
        _descriptor(q, BLOCK_M), _descriptor(k, BLOCK_N), _descriptor(v, BLOCK_N), _descriptor(dout, BLOCK_M),
        acc_desc, lse2, delta, dq, dk, dv, turns, seq, heads, bh, kv_blocks, scale * LOG2E, scale,
        *dq.stride()[:3], BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, D=HEAD_DIM, HALF_N=HALF_N, CHUNK=CHUNK, RING=RING,
        COMPUTE_REGS=COMPUTE_REGS, AGENT_REGS=AGENT_REGS, num_warps=COMPUTE_WARPS)
    return dq, dk, dv
