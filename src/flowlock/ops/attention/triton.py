"""Triton kernels, launchers and autograd boundary of full non-causal attention.

Layout: q, k, v, out and their gradients are ``(B, S, heads, D)`` with arbitrary strides and a
contiguous last dimension; the base-2 log-sum-exp ``lse2`` and ``delta`` are fp32 ``(B, heads, S)``.
``lse2[b, h, i] = log2(sum_j exp2(scale * log2(e) * q_i . k_j))``, so ``P = exp2(s2 - lse2)``.

Every program owns one (sample, head, row block) and walks the other sequence axis in ascending
blocks of a frozen size, so an element's result depends only on the data it is a function of:
no split-KV, no float atomics, nothing keyed by the batch size or the token count.

Rounding points (the reference follows them): scores in fp32 from input-dtype operands; softmax in
fp32 with ``exp2`` of the scores times the fp32 constant ``scale * log2(e)``; ``P`` (against the
running row maximum) rounded to the input dtype before ``P @ V``; fp32 accumulation; one final
rounding of ``O``. Backward: ``P`` recomputed in fp32 from ``lse2``; ``delta = rowsum(dO * O)``
in fp32 from the stored input-dtype ``O``; ``P`` and ``dS = P * (dP - delta)`` rounded to the
input dtype before their matmuls; ``dq``, ``dk``, ``dv`` accumulate in fp32, are scaled once and
rounded once.

Inputs are bf16, fp16 or fp32; every product accumulates in fp32, and fp32 operands are multiplied
in true fp32 (``input_precision="ieee"``, no TF32), where rounding ``P`` and ``dS`` "to the input
dtype" is no rounding at all. A head dim ``D`` is served by the power-of-two tile ``BLOCK_D`` (``D``
itself, or the next power of two: 48 -> 64, 80 and 96 -> 128): loads read zeros into the padding
columns and stores skip them, so the scores sum only zero products beyond ``D`` and padded outputs
are never written. A power-of-two ``D`` compiles exactly the kernel it did before padding existed
(every padding branch is a constexpr ``BLOCK_D != HEAD_DIM``).

Two variants of the forward, dK/dV and dQ kernels share one source and one arithmetic; the launch
config's ``TMA`` key names the variant. ``TMA=0`` reads every row block with a masked ``tl.load``
(any GPU, the interpreter). ``TMA=1`` (Hopper) reads the q, k, v and dO row blocks through
host-side tensor descriptors over the ``(B, S, heads * D)`` view with ``[1, BLOCK, D]`` boxes; the
hardware zero-fills the rows past the sample's end, exactly as the pointer variant's ``other=0``
does, so both variants compute the same values in the same order and agree bit for bit. Row
statistics and every output are written through pointers in both. A launch whose operands a
descriptor cannot describe (:func:`tma_eligible`, checked before the launch) runs the pointer
variant: a fixed layout rule, never a retry after a failure, and the same bits either way.

``DQ_FOLD=1`` in the dQ config sums dQ as per-KV-block terms, each from zero, added in ascending KV
order from +0 (one IEEE fp32 addition per block, :func:`flowlock.ops._dot.fold_add`), instead of one
chain of products over all KV rows: the order in which the one-pass kernel, whose programs each own
one KV block, adds their terms. Under the interpreter both orders are the same (its products are
always summed from zero and then added).

``GLUON=1`` in the forward config runs :mod:`flowlock.ops.attention.gluon_fwd` (Hopper, D = 128,
bf16 / fp16, q, k and v TMA-eligible) in place of the TMA variant: its 128 x 128 tiles and this
module's forward bits, each warpgroup's softmax run under its products. The frozen sm90 forward at
D = 128 sets it with the 128 x 128 tiles; other operands run the Triton forward under the same config.

``ONE_PASS=G`` (G > 0) in the dK/dV config runs :mod:`flowlock.ops.attention.gluon_bwd` (Hopper,
D = 128, bf16 / fp16, every operand TMA-eligible), its programs ticketed in groups of G heads: dK and
dV with this module's dK/dV bits, dQ with the dQ kernel's ``DQ_FOLD=1`` bits on 128-row KV blocks,
from one pass. Operands it does not serve run the separate kernels under the dQ config given. The
frozen sm90 configs at D = 128 set ``ONE_PASS=2`` and a dQ config with ``DQ_FOLD=1`` on 128-row KV
blocks, so both routes give one set of bits (``flowlock.config``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from flowlock.config import LaunchConfig, launch_config
from flowlock.keys import arch_of
from flowlock.ops._dot import dot_f32, fold_add
from flowlock.ops._kernel_op import kernel_op
from flowlock.ops._launch import fast_launch
from flowlock.ops._triton_utils import cdiv, traced
from flowlock.ops.attention import gluon_bwd, gluon_fwd
from flowlock.ops.attention.reference import LOG2E


@triton.jit
def _mma(a, b, acc, UPCAST: tl.constexpr):
    """``acc + a @ b`` in fp32. The interpreter gets fp32 operands (it computes bf16 dots wrongly;
    products of bf16 values are exact in fp32) and a product that does not go through the host BLAS.
    fp32 operands are multiplied in true fp32 (no TF32)."""
    if UPCAST:
        acc = acc + dot_f32(a.to(tl.float32), b.to(tl.float32))
    elif a.dtype == tl.float32:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _rows(base, start, offs, stride_s, BLOCK_D: tl.constexpr):
    """Pointers to rows ``start + offs`` (int64 offsets: S * row stride can exceed 2**31)."""
    rows = (start + offs).to(tl.int64) * stride_s
    return base + rows[:, None] + tl.arange(0, BLOCK_D)[None, :]


@triton.jit
def _in_head(row_ok, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr):
    """``(rows, BLOCK_D)`` mask of a row tile: ``row_ok`` rows, and, when the power-of-two tile pads
    the head (``BLOCK_D > HEAD_DIM``), only the head's own columns."""
    mask = row_ok[:, None]
    if BLOCK_D != HEAD_DIM:
        mask = mask & (tl.arange(0, BLOCK_D) < HEAD_DIM)[None, :]
    return mask


@triton.jit
def _head(src, b, h, stride_b, stride_h, TMA: tl.constexpr):
    """Operand ``src`` at sample ``b``, head ``h``: a descriptor as it is (boxes are addressed by
    coordinates), a pointer moved to that sample and head."""
    if TMA:
        base = src
    else:
        base = src + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h
    return base


@triton.jit
def _load_rows(src, b, col, start, seq, stride_s, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr,
               HEAD_DIM: tl.constexpr, MASK: tl.constexpr, TMA: tl.constexpr):
    """Rows ``start .. start + BLOCK`` of one (sample, head), zero past ``seq`` and past the head's
    ``HEAD_DIM`` columns: the box at ``[b, start, col]`` of a descriptor (zero-filled past the
    sample's end; only for unpadded heads) or a pointer load from a :func:`_head` base, masked when
    ``MASK`` (unmasked blocks lie inside the sequence) or when the tile pads the head."""
    if TMA:
        rows = src.load([b, start, col]).reshape(BLOCK, BLOCK_D)
    else:
        offs = tl.arange(0, BLOCK)
        ptrs = _rows(src, start, offs, stride_s, BLOCK_D)
        if MASK:
            rows = tl.load(ptrs, mask=_in_head((start + offs) < seq, BLOCK_D, HEAD_DIM), other=0.0)
        elif BLOCK_D != HEAD_DIM:
            rows = tl.load(ptrs, mask=_in_head(offs >= 0, BLOCK_D, HEAD_DIM), other=0.0)
        else:
            rows = tl.load(ptrs)
    return rows


@triton.jit
def _fwd_kv_block(acc, l_i, m_i, q, k_src, v_src, b, col, start_n, seq, stride_ks, stride_vs, qk_scale,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                  MASK_N: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr):
    k = _load_rows(k_src, b, col, start_n, seq, stride_ks, BLOCK_N, BLOCK_D, HEAD_DIM, MASK_N, TMA)
    v = _load_rows(v_src, b, col, start_n, seq, stride_vs, BLOCK_N, BLOCK_D, HEAD_DIM, MASK_N, TMA)
    qk = _mma(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), UPCAST)
    if MASK_N:
        qk = tl.where(((start_n + tl.arange(0, BLOCK_N)) < seq)[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    p = tl.math.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = _mma(p.to(k.dtype), v, acc * alpha[:, None], UPCAST)
    return acc, l_i, m_new


@fast_launch
@triton.jit
def _attention_fwd_kernel(Q, K, V, Out, Lse2, seq, heads, qk_scale,
                          stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                          stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                          UPCAST: tl.constexpr, TMA: tl.constexpr):
    """One program per (query block, sample * heads): online softmax over ascending KV blocks.
    ``Q``, ``K``, ``V`` are descriptors when ``TMA``, pointers otherwise."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // heads
    h = pid_bh % heads
    col = h * HEAD_DIM
    start_m = pid_m * BLOCK_M
    offs_m = tl.arange(0, BLOCK_M)
    row_ok = (start_m + offs_m) < seq
    q = _load_rows(_head(Q, b, h, stride_qb, stride_qh, TMA), b, col, start_m, seq, stride_qs,
                   BLOCK_M, BLOCK_D, HEAD_DIM, True, TMA)
    k_src = _head(K, b, h, stride_kb, stride_kh, TMA)
    v_src = _head(V, b, h, stride_vb, stride_vh, TMA)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n_full = (seq // BLOCK_N) * BLOCK_N
    for start_n in range(0, n_full, BLOCK_N):
        acc, l_i, m_i = _fwd_kv_block(acc, l_i, m_i, q, k_src, v_src, b, col, start_n, seq, stride_ks, stride_vs,
                                      qk_scale, BLOCK_M, BLOCK_N, BLOCK_D, HEAD_DIM, False, UPCAST, TMA)
    if n_full < seq:
        acc, l_i, m_i = _fwd_kv_block(acc, l_i, m_i, q, k_src, v_src, b, col, n_full, seq, stride_ks, stride_vs,
                                      qk_scale, BLOCK_M, BLOCK_N, BLOCK_D, HEAD_DIM, True, UPCAST, TMA)
    out = acc / l_i[:, None]
    o_ptrs = _rows(_head(Out, b, h, stride_ob, stride_oh, False), start_m, offs_m, stride_os, BLOCK_D)
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=_in_head(row_ok, BLOCK_D, HEAD_DIM))
    lse_ptrs = Lse2 + pid_bh.to(tl.int64) * seq + start_m + offs_m
    tl.store(lse_ptrs, m_i + tl.math.log2(l_i), mask=row_ok)


@fast_launch
@triton.jit
def _attention_bwd_delta_kernel(Out, dOut, Delta, seq, heads,
                                stride_ob, stride_os, stride_oh, stride_db, stride_ds, stride_dh,
                                BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr):
    """``delta[b, h, i] = sum_d dO[b, i, h, d] * O[b, i, h, d]`` in fp32."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // heads).to(tl.int64)
    h = (pid_bh % heads).to(tl.int64)
    start_m = pid_m * BLOCK_M
    offs_m = tl.arange(0, BLOCK_M)
    row_ok = (start_m + offs_m) < seq
    o = tl.load(_rows(Out + b * stride_ob + h * stride_oh, start_m, offs_m, stride_os, BLOCK_D),
                mask=_in_head(row_ok, BLOCK_D, HEAD_DIM), other=0.0)
    do = tl.load(_rows(dOut + b * stride_db + h * stride_dh, start_m, offs_m, stride_ds, BLOCK_D),
                 mask=_in_head(row_ok, BLOCK_D, HEAD_DIM), other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + pid_bh.to(tl.int64) * seq + start_m + offs_m, delta, mask=row_ok)


@triton.jit
def _dkdv_q_block(dk, dv, k, v, q_src, do_src, lse_base, delta_base, b, col, start_m, seq,
                  stride_qs, stride_ds, qk_scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, MASK_M: tl.constexpr, UPCAST: tl.constexpr,
                  TMA: tl.constexpr, DP_FIRST: tl.constexpr):
    offs_m = tl.arange(0, BLOCK_M)
    q = _load_rows(q_src, b, col, start_m, seq, stride_qs, BLOCK_M, BLOCK_D, HEAD_DIM, MASK_M, TMA)
    do = _load_rows(do_src, b, col, start_m, seq, stride_ds, BLOCK_M, BLOCK_D, HEAD_DIM, MASK_M, TMA)
    if MASK_M:
        valid = (start_m + offs_m) < seq
        # +inf makes P exactly 0 on rows past the sequence end
        lse = tl.load(lse_base + start_m + offs_m, mask=valid, other=float("inf"))
        delta = tl.load(delta_base + start_m + offs_m, mask=valid, other=0.0)
    else:
        lse = tl.load(lse_base + start_m + offs_m)
        delta = tl.load(delta_base + start_m + offs_m)
    qk_t = _mma(k, tl.trans(q), tl.zeros([BLOCK_N, BLOCK_M], tl.float32), UPCAST)
    # DP_FIRST issues the independent dP product before the exponentials, so the tensor cores can
    # run while the SFU computes P; the values and their order are the same either way
    if DP_FIRST:
        dp_t = _mma(v, tl.trans(do), tl.zeros([BLOCK_N, BLOCK_M], tl.float32), UPCAST)
    p_t = tl.math.exp2(qk_t * qk_scale - lse[None, :])
    dv = _mma(p_t.to(k.dtype), do, dv, UPCAST)
    if not DP_FIRST:
        dp_t = _mma(v, tl.trans(do), tl.zeros([BLOCK_N, BLOCK_M], tl.float32), UPCAST)
    ds_t = p_t * (dp_t - delta[None, :])
    ds_t = ds_t.to(k.dtype)
    dk = _mma(ds_t, q, dk, UPCAST)
    return dk, dv


@fast_launch
@triton.jit
def _attention_bwd_dkdv_kernel(Q, K, V, dOut, Lse2, Delta, dK, dV, seq, heads, qk_scale, sm_scale,
                               stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                               stride_vb, stride_vs, stride_vh, stride_db, stride_ds, stride_dh,
                               stride_gb, stride_gs, stride_gh,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                               HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr,
                               DP_FIRST: tl.constexpr):
    """One program per (KV block, sample * heads) owns its dK, dV rows; query blocks ascend.
    ``dK``, ``dV`` share the strides ``stride_g*``; ``Q``, ``K``, ``V``, ``dOut`` are descriptors
    when ``TMA``."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // heads
    h = pid_bh % heads
    col = h * HEAD_DIM
    start_n = pid_n * BLOCK_N
    offs_n = tl.arange(0, BLOCK_N)
    row_ok = (start_n + offs_n) < seq
    k = _load_rows(_head(K, b, h, stride_kb, stride_kh, TMA), b, col, start_n, seq, stride_ks,
                   BLOCK_N, BLOCK_D, HEAD_DIM, True, TMA)
    v = _load_rows(_head(V, b, h, stride_vb, stride_vh, TMA), b, col, start_n, seq, stride_vs,
                   BLOCK_N, BLOCK_D, HEAD_DIM, True, TMA)
    q_src = _head(Q, b, h, stride_qb, stride_qh, TMA)
    do_src = _head(dOut, b, h, stride_db, stride_dh, TMA)
    lse_base = Lse2 + pid_bh.to(tl.int64) * seq
    delta_base = Delta + pid_bh.to(tl.int64) * seq
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    m_full = (seq // BLOCK_M) * BLOCK_M
    for start_m in range(0, m_full, BLOCK_M):
        dk, dv = _dkdv_q_block(dk, dv, k, v, q_src, do_src, lse_base, delta_base, b, col, start_m, seq,
                               stride_qs, stride_ds, qk_scale, BLOCK_M, BLOCK_N, BLOCK_D, HEAD_DIM, False,
                               UPCAST, TMA, DP_FIRST)
    if m_full < seq:
        dk, dv = _dkdv_q_block(dk, dv, k, v, q_src, do_src, lse_base, delta_base, b, col, m_full, seq,
                               stride_qs, stride_ds, qk_scale, BLOCK_M, BLOCK_N, BLOCK_D, HEAD_DIM, True,
                               UPCAST, TMA, DP_FIRST)
    g_off = b.to(tl.int64) * stride_gb + h.to(tl.int64) * stride_gh
    tl.store(_rows(dK + g_off, start_n, offs_n, stride_gs, BLOCK_D),
             (dk * sm_scale).to(dK.dtype.element_ty), mask=_in_head(row_ok, BLOCK_D, HEAD_DIM))
    tl.store(_rows(dV + g_off, start_n, offs_n, stride_gs, BLOCK_D),
             dv.to(dV.dtype.element_ty), mask=_in_head(row_ok, BLOCK_D, HEAD_DIM))


@triton.jit
def _dq_kv_block(dq, q, do, lse, delta, k_src, v_src, b, col, start_n, seq, stride_ks, stride_vs, qk_scale,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                 MASK_N: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr, DP_FIRST: tl.constexpr,
                 DQ_FOLD: tl.constexpr):
    k = _load_rows(k_src, b, col, start_n, seq, stride_ks, BLOCK_N, BLOCK_D, HEAD_DIM, MASK_N, TMA)
    v = _load_rows(v_src, b, col, start_n, seq, stride_vs, BLOCK_N, BLOCK_D, HEAD_DIM, MASK_N, TMA)
    qk = _mma(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), UPCAST)
    if DP_FIRST:
        dp = _mma(do, tl.trans(v), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), UPCAST)
    p = tl.math.exp2(qk * qk_scale - lse[:, None])
    if MASK_N:
        p = tl.where(((start_n + tl.arange(0, BLOCK_N)) < seq)[None, :], p, 0.0)
    if not DP_FIRST:
        dp = _mma(do, tl.trans(v), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), UPCAST)
    ds = p * (dp - delta[:, None])
    if DQ_FOLD:
        # the block's term from zero, then one fp32 addition (fold_add stops the compiler from issuing
        # the product onto dq, which would be the chained order)
        return fold_add(dq, _mma(ds.to(k.dtype), k, tl.zeros([BLOCK_M, BLOCK_D], tl.float32), UPCAST))
    return _mma(ds.to(k.dtype), k, dq, UPCAST)


@fast_launch
@triton.jit
def _attention_bwd_dq_kernel(Q, K, V, dOut, Lse2, Delta, dQ, seq, heads, qk_scale, sm_scale,
                             stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                             stride_vb, stride_vs, stride_vh, stride_db, stride_ds, stride_dh,
                             stride_gb, stride_gs, stride_gh,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                             HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr, TMA: tl.constexpr,
                             DP_FIRST: tl.constexpr, DQ_FOLD: tl.constexpr):
    """One program per (query block, sample * heads) owns its dQ rows; KV blocks ascend
    (``P`` and ``dP`` are recomputed rather than accumulated across programs). ``Q``, ``K``,
    ``V``, ``dOut`` are descriptors when ``TMA``."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // heads
    h = pid_bh % heads
    col = h * HEAD_DIM
    start_m = pid_m * BLOCK_M
    offs_m = tl.arange(0, BLOCK_M)
    row_ok = (start_m + offs_m) < seq
    q = _load_rows(_head(Q, b, h, stride_qb, stride_qh, TMA), b, col, start_m, seq, stride_qs,
                   BLOCK_M, BLOCK_D, HEAD_DIM, True, TMA)
    do = _load_rows(_head(dOut, b, h, stride_db, stride_dh, TMA), b, col, start_m, seq, stride_ds,
                    BLOCK_M, BLOCK_D, HEAD_DIM, True, TMA)
    lse = tl.load(Lse2 + pid_bh.to(tl.int64) * seq + start_m + offs_m, mask=row_ok, other=0.0)
    delta = tl.load(Delta + pid_bh.to(tl.int64) * seq + start_m + offs_m, mask=row_ok, other=0.0)
    k_src = _head(K, b, h, stride_kb, stride_kh, TMA)
    v_src = _head(V, b, h, stride_vb, stride_vh, TMA)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n_full = (seq // BLOCK_N) * BLOCK_N
    for start_n in range(0, n_full, BLOCK_N):
        dq = _dq_kv_block(dq, q, do, lse, delta, k_src, v_src, b, col, start_n, seq, stride_ks, stride_vs,
                          qk_scale, BLOCK_M, BLOCK_N, BLOCK_D, HEAD_DIM, False, UPCAST, TMA, DP_FIRST, DQ_FOLD)
    if n_full < seq:
        dq = _dq_kv_block(dq, q, do, lse, delta, k_src, v_src, b, col, n_full, seq, stride_ks, stride_vs,
                          qk_scale, BLOCK_M, BLOCK_N, BLOCK_D, HEAD_DIM, True, UPCAST, TMA, DP_FIRST, DQ_FOLD)
    tl.store(_rows(_head(dQ, b, h, stride_gb, stride_gh, False), start_m, offs_m, stride_gs, BLOCK_D),
             (dq * sm_scale).to(dQ.dtype.element_ty), mask=_in_head(row_ok, BLOCK_D, HEAD_DIM))


class _Tiles(NamedTuple):
    """One kernel's launch parameters, read once from its :class:`LaunchConfig`."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: bool
    dp_first: bool
    dq_fold: bool
    one_pass: int
    gluon: bool


def _tiles(cfg: LaunchConfig) -> _Tiles:
    """A config without ``BLOCK_N`` (the delta kernel), ``TMA`` (pointer-only configs), ``DP_FIRST``
    (backward instruction order), ``DQ_FOLD`` (dQ folded per KV block), ``ONE_PASS`` (the one-pass
    backward) or ``GLUON`` (the Gluon forward) reads them as 0."""
    blocks = dict(cfg.blocks)
    return _Tiles(blocks["BLOCK_M"], blocks.get("BLOCK_N", 0), cfg.num_warps, cfg.num_stages,
                  bool(blocks.get("TMA", 0)), bool(blocks.get("DP_FIRST", 0)), bool(blocks.get("DQ_FOLD", 0)),
                  blocks.get("ONE_PASS", 0), bool(blocks.get("GLUON", 0)))


class _Frozen(NamedTuple):
    fwd: _Tiles
    delta: _Tiles
    dkdv: _Tiles
    dq: _Tiles


def block_d(dim: int) -> int:
    """The power-of-two tile width serving head dim ``dim``: ``dim`` itself when it is a power of two,
    else the next one (the kernels mask the padding columns: zeros in every product)."""
    return 1 << (dim - 1).bit_length()


@functools.cache
def _frozen(dtype: torch.dtype, arch: str, dim: int) -> _Frozen:
    """The frozen configs of the four kernels, looked up once per (dtype, arch, head dim); they are
    keyed by the tile width :func:`block_d`, so a padded head runs its tile's configs."""
    return _Frozen(*(_tiles(launch_config(op, dtype, arch, (block_d(dim),))) for op in
                     ("attention_fwd", "attention_bwd_delta", "attention_bwd_dkdv", "attention_bwd_dq")))


def tma_eligible(t: torch.Tensor) -> bool:
    """Whether a ``(B, S, heads, D)`` operand can be read through a descriptor over its
    ``(B, S, heads * D)`` view: a power-of-two ``D`` (a descriptor box is one whole tile; padded
    heads load through masked pointers), heads side by side (head stride ``D``, unit last stride),
    a 16-byte aligned base and 16-byte multiples as sample and row strides. Contiguous tensors and views of a
    fused qkv projection (row stride ``3 * heads * D``) qualify; expanded or head-major (BHSD
    transposed) layouts do not, and their launches run the pointer variant (same bits)."""
    stride_b, stride_s, stride_h, stride_d = t.stride()
    size = t.element_size()
    return (stride_d == 1 and stride_h == t.shape[3] and block_d(t.shape[3]) == t.shape[3] and t.data_ptr() % 16 == 0
            and (stride_b * size) % 16 == 0 and (stride_s * size) % 16 == 0)


def _operand(t: torch.Tensor, block: int, tma: bool):
    """``t`` as a kernel argument: a descriptor with ``[1, block, D]`` boxes over its
    ``(B, S, heads * D)`` view when ``tma``, else the tensor itself (a pointer)."""
    if not tma:
        return t
    batch, seq, heads, dim = t.shape
    return TensorDescriptor(t, [batch, seq, heads * dim], [t.stride(0), t.stride(1), 1], [1, block, dim])


def _sbh(t: torch.Tensor) -> tuple[int, int, int]:
    """(batch, sequence, head) strides of a (B, S, heads, D) tensor with a contiguous last dim."""
    return t.stride()[:3]


def attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  config: LaunchConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward on validated inputs: returns ``out`` (B, S, heads, D) in ``q.dtype`` and
    ``lse2`` (B, heads, S) fp32. ``config`` replaces the frozen one (benchmark sweeps, tests); the
    TMA variant runs when the config says ``TMA=1`` and q, k, v are all :func:`tma_eligible`, and the
    Gluon forward in its place when the config also says ``GLUON=1`` and it serves the operands."""
    batch, seq, heads, dim = q.shape
    arch = arch_of(q)
    t = _frozen(q.dtype, arch, dim).fwd if config is None else _tiles(config)
    tma = t.tma and tma_eligible(q) and tma_eligible(k) and tma_eligible(v)
    if t.gluon and tma and gluon_fwd.applies(q):
        return gluon_fwd.attention_fwd_ws(q, k, v, scale)
    out = torch.empty((batch, seq, heads, dim), dtype=q.dtype, device=q.device)
    lse2 = torch.empty((batch, heads, seq), dtype=torch.float32, device=q.device)
    _attention_fwd_kernel[(cdiv(seq, t.block_m), batch * heads)](
        _operand(q, t.block_m, tma), _operand(k, t.block_n, tma), _operand(v, t.block_n, tma), out, lse2,
        seq, heads, scale * LOG2E, *_sbh(q), *_sbh(k), *_sbh(v), *_sbh(out),
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_D=block_d(dim), HEAD_DIM=dim, UPCAST=arch == "interp", TMA=tma,
        num_warps=t.num_warps, num_stages=t.num_stages,
    )
    return out, lse2


def attention_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse2: torch.Tensor, scale: float, dkdv_config: LaunchConfig | None = None,
                  dq_config: LaunchConfig | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the backward (delta, then dK/dV, then dQ): returns ``dq, dk, dv`` shaped and typed
    like ``q`` (contiguous). ``dout`` may be strided but needs a contiguous last dim. A kernel
    runs its TMA variant when its config says ``TMA=1`` and q, k, v, dout are all
    :func:`tma_eligible`."""
    batch, seq, heads, dim = q.shape
    arch = arch_of(q)
    upcast = arch == "interp"
    frozen = _frozen(q.dtype, arch, dim)
    dkdv_t = frozen.dkdv if dkdv_config is None else _tiles(dkdv_config)
    dq_t = frozen.dq if dq_config is None else _tiles(dq_config)
    eligible = (dkdv_t.tma or dq_t.tma) and all(tma_eligible(t) for t in (q, k, v, dout))
    delta = torch.empty((batch, heads, seq), dtype=torch.float32, device=q.device)
    _attention_bwd_delta_kernel[(cdiv(seq, frozen.delta.block_m), batch * heads)](
        out, dout, delta, seq, heads, *_sbh(out), *_sbh(dout),
        BLOCK_M=frozen.delta.block_m, BLOCK_D=block_d(dim), HEAD_DIM=dim,
        num_warps=frozen.delta.num_warps, num_stages=frozen.delta.num_stages,
    )
    if dkdv_t.one_pass and eligible and gluon_bwd.applies(q):
        return gluon_bwd.attention_bwd_one_pass(q, k, v, dout, lse2, delta, scale, dkdv_t.one_pass)
    dq = torch.empty((batch, seq, heads, dim), dtype=q.dtype, device=q.device)
    dk = torch.empty_like(dq)
    dv = torch.empty_like(dq)
    # the scales and the q, k, v, dO, grad strides both kernels take after their own leading arguments
    common = (scale * LOG2E, scale, *_sbh(q), *_sbh(k), *_sbh(v), *_sbh(dout), *_sbh(dq))
    t = dkdv_t
    tma = t.tma and eligible
    _attention_bwd_dkdv_kernel[(cdiv(seq, t.block_n), batch * heads)](
        _operand(q, t.block_m, tma), _operand(k, t.block_n, tma), _operand(v, t.block_n, tma),
        _operand(dout, t.block_m, tma), lse2, delta, dk, dv, seq, heads, *common,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_D=block_d(dim), HEAD_DIM=dim, UPCAST=upcast, TMA=tma,
        DP_FIRST=t.dp_first, num_warps=t.num_warps, num_stages=t.num_stages,
    )
    t = dq_t
    tma = t.tma and eligible
    _attention_bwd_dq_kernel[(cdiv(seq, t.block_m), batch * heads)](
        _operand(q, t.block_m, tma), _operand(k, t.block_n, tma), _operand(v, t.block_n, tma),
        _operand(dout, t.block_m, tma), lse2, delta, dq, seq, heads, *common,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_D=block_d(dim), HEAD_DIM=dim, UPCAST=upcast, TMA=tma,
        DP_FIRST=t.dp_first, DQ_FOLD=t.dq_fold, num_warps=t.num_warps, num_stages=t.num_stages,
    )
    return dq, dk, dv


@kernel_op("flowlock::attention_fwd")
def attention_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward as one opaque op, so torch.compile and CUDA graphs replay the same launch."""
    return attention_fwd(q, k, v, scale)


@attention_fwd_op.register_fake
def _(q, k, v, scale):
    batch, seq, heads, dim = q.shape
    return q.new_empty((batch, seq, heads, dim)), q.new_empty((batch, heads, seq), dtype=torch.float32)


@kernel_op("flowlock::attention_bwd")
def _attention_bwd_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                      lse2: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward as one opaque op (see :func:`attention_bwd`)."""
    return attention_bwd(dout, q, k, v, out, lse2, scale)


@_attention_bwd_op.register_fake
def _(dout, q, k, v, out, lse2, scale):
    return q.new_empty(q.shape), q.new_empty(q.shape), q.new_empty(q.shape)


class AttentionFunction(torch.autograd.Function):
    """Autograd boundary (the custom ops while tracing, the launchers in eager mode): saves q, k,
    v, out and the fp32 ``lse2`` (O(S) extra memory)."""

    @staticmethod
    def forward(ctx, q, k, v, scale):
        out, lse2 = (attention_fwd_op if traced() else attention_fwd)(q, k, v, scale)
        ctx.save_for_backward(q, k, v, out, lse2)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse2 = ctx.saved_tensors
        if dout.stride(-1) != 1:
            # the kernels address D with unit stride; an expanded or transposed incoming gradient
            # gets one contiguous copy
            dout = dout.contiguous()
        dq, dk, dv = (_attention_bwd_op if traced() else attention_bwd)(dout, q, k, v, out, lse2, ctx.scale)
        return dq, dk, dv, None
