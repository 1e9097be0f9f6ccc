"""Triton kernels, launchers and autograd boundary of full non-causal attention.

Layout: q, k, v, out and their gradients are ``(B, S, heads, D)`` with arbitrary strides and a
contiguous last dimension; the base-2 log-sum-exp ``lse2`` and ``delta`` are fp32 ``(B, heads, S)``.
``lse2[b, h, i] = log2(sum_j exp2(scale * log2(e) * q_i . k_j))``, so ``P = exp2(s2 - lse2)``.

Every program owns one (sample, head, row block) and walks the other sequence axis in ascending
blocks of a frozen size, so an element's result depends only on the data it is a function of:
no split-KV, no atomics, nothing keyed by the batch size or the token count.

Rounding points (the reference follows them): scores in fp32 from input-dtype operands; softmax in
fp32 with ``exp2`` of the scores times the fp32 constant ``scale * log2(e)``; ``P`` (against the
running row maximum) rounded to the input dtype before ``P @ V``; fp32 accumulation; one final
rounding of ``O``. Backward: ``P`` recomputed in fp32 from ``lse2``; ``delta = rowsum(dO * O)``
in fp32 from the stored input-dtype ``O``; ``P`` and ``dS = P * (dP - delta)`` rounded to the
input dtype before their matmuls; ``dq``, ``dk``, ``dv`` accumulate in fp32, are scaled once and
rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flowlock.config import LaunchConfig, launch_config
from flowlock.dispatch import interpreter_active
from flowlock.ops._triton_utils import arch_of, traced
from flowlock.ops.attention.reference import LOG2E


@triton.jit
def _mma(a, b, acc, UPCAST: tl.constexpr):
    """``acc + a @ b`` in fp32. The interpreter gets fp32 operands (it computes bf16 dots wrongly;
    products of bf16 values are exact in fp32)."""
    if UPCAST:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _rows(base, start, offs, stride_s, HEAD_DIM: tl.constexpr):
    """Pointers to rows ``start + offs`` (int64 offsets: S * row stride can exceed 2**31)."""
    rows = (start + offs).to(tl.int64) * stride_s
    return base + rows[:, None] + tl.arange(0, HEAD_DIM)[None, :]


@triton.jit
def _load_kv_block(k_base, v_base, start_n, seq, stride_ks, stride_vs, BLOCK_N: tl.constexpr,
                   HEAD_DIM: tl.constexpr, MASK_N: tl.constexpr):
    """The K and V rows ``start_n .. start_n + BLOCK_N`` (zero past ``seq`` when ``MASK_N``) and the
    validity of each row."""
    offs_n = tl.arange(0, BLOCK_N)
    valid = (start_n + offs_n) < seq
    k_ptrs = _rows(k_base, start_n, offs_n, stride_ks, HEAD_DIM)
    v_ptrs = _rows(v_base, start_n, offs_n, stride_vs, HEAD_DIM)
    if MASK_N:
        k = tl.load(k_ptrs, mask=valid[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=valid[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    return k, v, valid


@triton.jit
def _fwd_kv_block(acc, l_i, m_i, q, k_base, v_base, start_n, seq, stride_ks, stride_vs, qk_scale,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                  MASK_N: tl.constexpr, UPCAST: tl.constexpr):
    k, v, valid = _load_kv_block(k_base, v_base, start_n, seq, stride_ks, stride_vs, BLOCK_N, HEAD_DIM, MASK_N)
    qk = _mma(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), UPCAST)
    if MASK_N:
        qk = tl.where(valid[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    p = tl.math.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = _mma(p.to(k.dtype), v, acc * alpha[:, None], UPCAST)
    return acc, l_i, m_new


@triton.jit
def _attention_fwd_kernel(Q, K, V, Out, Lse2, seq, heads, qk_scale,
                          stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                          stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                          UPCAST: tl.constexpr):
    """One program per (query block, sample * heads): online softmax over ascending KV blocks."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // heads).to(tl.int64)
    h = (pid_bh % heads).to(tl.int64)
    start_m = pid_m * BLOCK_M
    offs_m = tl.arange(0, BLOCK_M)
    row_ok = (start_m + offs_m) < seq
    q = tl.load(_rows(Q + b * stride_qb + h * stride_qh, start_m, offs_m, stride_qs, HEAD_DIM),
                mask=row_ok[:, None], other=0.0)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    n_full = (seq // BLOCK_N) * BLOCK_N
    for start_n in range(0, n_full, BLOCK_N):
        acc, l_i, m_i = _fwd_kv_block(acc, l_i, m_i, q, k_base, v_base, start_n, seq, stride_ks,
                                      stride_vs, qk_scale, BLOCK_M, BLOCK_N, HEAD_DIM, False, UPCAST)
    if n_full < seq:
        acc, l_i, m_i = _fwd_kv_block(acc, l_i, m_i, q, k_base, v_base, n_full, seq, stride_ks,
                                      stride_vs, qk_scale, BLOCK_M, BLOCK_N, HEAD_DIM, True, UPCAST)
    out = acc / l_i[:, None]
    o_ptrs = _rows(Out + b * stride_ob + h * stride_oh, start_m, offs_m, stride_os, HEAD_DIM)
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None])
    lse_ptrs = Lse2 + pid_bh.to(tl.int64) * seq + start_m + offs_m
    tl.store(lse_ptrs, m_i + tl.math.log2(l_i), mask=row_ok)


@triton.jit
def _attention_bwd_delta_kernel(Out, dOut, Delta, seq, heads,
                                stride_ob, stride_os, stride_oh, stride_db, stride_ds, stride_dh,
                                BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """``delta[b, h, i] = sum_d dO[b, i, h, d] * O[b, i, h, d]`` in fp32."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // heads).to(tl.int64)
    h = (pid_bh % heads).to(tl.int64)
    start_m = pid_m * BLOCK_M
    offs_m = tl.arange(0, BLOCK_M)
    row_ok = (start_m + offs_m) < seq
    o = tl.load(_rows(Out + b * stride_ob + h * stride_oh, start_m, offs_m, stride_os, HEAD_DIM),
                mask=row_ok[:, None], other=0.0)
    do = tl.load(_rows(dOut + b * stride_db + h * stride_dh, start_m, offs_m, stride_ds, HEAD_DIM),
                 mask=row_ok[:, None], other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + pid_bh.to(tl.int64) * seq + start_m + offs_m, delta, mask=row_ok)


@triton.jit
def _dkdv_q_block(dk, dv, k, v, q_base, do_base, lse_base, delta_base, start_m, seq,
                  stride_qs, stride_ds, qk_scale,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                  MASK_M: tl.constexpr, UPCAST: tl.constexpr):
    offs_m = tl.arange(0, BLOCK_M)
    q_ptrs = _rows(q_base, start_m, offs_m, stride_qs, HEAD_DIM)
    do_ptrs = _rows(do_base, start_m, offs_m, stride_ds, HEAD_DIM)
    valid = (start_m + offs_m) < seq
    if MASK_M:
        q = tl.load(q_ptrs, mask=valid[:, None], other=0.0)
        do = tl.load(do_ptrs, mask=valid[:, None], other=0.0)
        # +inf makes P exactly 0 on rows past the sequence end
        lse = tl.load(lse_base + start_m + offs_m, mask=valid, other=float("inf"))
        delta = tl.load(delta_base + start_m + offs_m, mask=valid, other=0.0)
    else:
        q = tl.load(q_ptrs)
        do = tl.load(do_ptrs)
        lse = tl.load(lse_base + start_m + offs_m)
        delta = tl.load(delta_base + start_m + offs_m)
    qk_t = _mma(k, tl.trans(q), tl.zeros([BLOCK_N, BLOCK_M], tl.float32), UPCAST)
    p_t = tl.math.exp2(qk_t * qk_scale - lse[None, :])
    dv = _mma(p_t.to(k.dtype), do, dv, UPCAST)
    dp_t = _mma(v, tl.trans(do), tl.zeros([BLOCK_N, BLOCK_M], tl.float32), UPCAST)
    ds_t = p_t * (dp_t - delta[None, :])
    dk = _mma(ds_t.to(k.dtype), q, dk, UPCAST)
    return dk, dv


@triton.jit
def _attention_bwd_dkdv_kernel(Q, K, V, dOut, Lse2, Delta, dK, dV, seq, heads, qk_scale, sm_scale,
                               stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                               stride_vb, stride_vs, stride_vh, stride_db, stride_ds, stride_dh,
                               stride_gb, stride_gs, stride_gh,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                               UPCAST: tl.constexpr):
    """One program per (KV block, sample * heads) owns its dK, dV rows; query blocks ascend.
    ``dK`` and ``dV`` share the strides ``stride_g*``."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // heads).to(tl.int64)
    h = (pid_bh % heads).to(tl.int64)
    start_n = pid_n * BLOCK_N
    offs_n = tl.arange(0, BLOCK_N)
    row_ok = (start_n + offs_n) < seq
    k = tl.load(_rows(K + b * stride_kb + h * stride_kh, start_n, offs_n, stride_ks, HEAD_DIM),
                mask=row_ok[:, None], other=0.0)
    v = tl.load(_rows(V + b * stride_vb + h * stride_vh, start_n, offs_n, stride_vs, HEAD_DIM),
                mask=row_ok[:, None], other=0.0)
    q_base = Q + b * stride_qb + h * stride_qh
    do_base = dOut + b * stride_db + h * stride_dh
    lse_base = Lse2 + pid_bh.to(tl.int64) * seq
    delta_base = Delta + pid_bh.to(tl.int64) * seq
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    m_full = (seq // BLOCK_M) * BLOCK_M
    for start_m in range(0, m_full, BLOCK_M):
        dk, dv = _dkdv_q_block(dk, dv, k, v, q_base, do_base, lse_base, delta_base, start_m, seq,
                               stride_qs, stride_ds, qk_scale, BLOCK_M, BLOCK_N, HEAD_DIM, False, UPCAST)
    if m_full < seq:
        dk, dv = _dkdv_q_block(dk, dv, k, v, q_base, do_base, lse_base, delta_base, m_full, seq,
                               stride_qs, stride_ds, qk_scale, BLOCK_M, BLOCK_N, HEAD_DIM, True, UPCAST)
    g_off = b * stride_gb + h * stride_gh
    tl.store(_rows(dK + g_off, start_n, offs_n, stride_gs, HEAD_DIM),
             (dk * sm_scale).to(dK.dtype.element_ty), mask=row_ok[:, None])
    tl.store(_rows(dV + g_off, start_n, offs_n, stride_gs, HEAD_DIM),
             dv.to(dV.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _dq_kv_block(dq, q, do, lse, delta, k_base, v_base, start_n, seq, stride_ks, stride_vs, qk_scale,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                 MASK_N: tl.constexpr, UPCAST: tl.constexpr):
    k, v, valid = _load_kv_block(k_base, v_base, start_n, seq, stride_ks, stride_vs, BLOCK_N, HEAD_DIM, MASK_N)
    qk = _mma(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), UPCAST)
    p = tl.math.exp2(qk * qk_scale - lse[:, None])
    if MASK_N:
        p = tl.where(valid[None, :], p, 0.0)
    dp = _mma(do, tl.trans(v), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), UPCAST)
    ds = p * (dp - delta[:, None])
    return _mma(ds.to(k.dtype), k, dq, UPCAST)


@triton.jit
def _attention_bwd_dq_kernel(Q, K, V, dOut, Lse2, Delta, dQ, seq, heads, qk_scale, sm_scale,
                             stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                             stride_vb, stride_vs, stride_vh, stride_db, stride_ds, stride_dh,
                             stride_gb, stride_gs, stride_gh,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                             UPCAST: tl.constexpr):
    """One program per (query block, sample * heads) owns its dQ rows; KV blocks ascend
    (``P`` and ``dP`` are recomputed rather than accumulated across programs)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // heads).to(tl.int64)
    h = (pid_bh % heads).to(tl.int64)
    start_m = pid_m * BLOCK_M
    offs_m = tl.arange(0, BLOCK_M)
    row_ok = (start_m + offs_m) < seq
    q = tl.load(_rows(Q + b * stride_qb + h * stride_qh, start_m, offs_m, stride_qs, HEAD_DIM),
                mask=row_ok[:, None], other=0.0)
    do = tl.load(_rows(dOut + b * stride_db + h * stride_dh, start_m, offs_m, stride_ds, HEAD_DIM),
                 mask=row_ok[:, None], other=0.0)
    lse = tl.load(Lse2 + pid_bh.to(tl.int64) * seq + start_m + offs_m, mask=row_ok, other=0.0)
    delta = tl.load(Delta + pid_bh.to(tl.int64) * seq + start_m + offs_m, mask=row_ok, other=0.0)
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    n_full = (seq // BLOCK_N) * BLOCK_N
    for start_n in range(0, n_full, BLOCK_N):
        dq = _dq_kv_block(dq, q, do, lse, delta, k_base, v_base, start_n, seq, stride_ks, stride_vs,
                          qk_scale, BLOCK_M, BLOCK_N, HEAD_DIM, False, UPCAST)
    if n_full < seq:
        dq = _dq_kv_block(dq, q, do, lse, delta, k_base, v_base, n_full, seq, stride_ks, stride_vs,
                          qk_scale, BLOCK_M, BLOCK_N, HEAD_DIM, True, UPCAST)
    tl.store(_rows(dQ + b * stride_gb + h * stride_gh, start_m, offs_m, stride_gs, HEAD_DIM),
             (dq * sm_scale).to(dQ.dtype.element_ty), mask=row_ok[:, None])


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(batch, sequence, head) strides of a (B, S, heads, D) tensor with a contiguous last dim."""
    return t.stride(0), t.stride(1), t.stride(2)


def _config(op: str, t: torch.Tensor) -> LaunchConfig:
    return launch_config(op, t.dtype, arch_of(t), (t.shape[-1],))


def attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  config: LaunchConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward on validated inputs: returns ``out`` (B, S, heads, D) in ``q.dtype`` and
    ``lse2`` (B, heads, S) fp32. ``config`` replaces the frozen one (benchmark sweeps, tests)."""
    batch, seq, heads, dim = q.shape
    cfg = config or _config("attention_fwd", q)
    out = torch.empty((batch, seq, heads, dim), dtype=q.dtype, device=q.device)
    lse2 = torch.empty((batch, heads, seq), dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(seq, cfg["BLOCK_M"]), batch * heads)
    _attention_fwd_kernel[grid](
        q, k, v, out, lse2, seq, heads, scale * LOG2E,
        *_strides(q), *_strides(k), *_strides(v), *_strides(out),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], HEAD_DIM=dim, UPCAST=interpreter_active(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out, lse2


def attention_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse2: torch.Tensor, scale: float, dkdv_config: LaunchConfig | None = None,
                  dq_config: LaunchConfig | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the backward (delta, then dK/dV, then dQ): returns ``dq, dk, dv`` shaped and typed
    like ``q`` (contiguous). ``dout`` may be strided but needs a contiguous last dim."""
    batch, seq, heads, dim = q.shape
    upcast = interpreter_active()
    delta_cfg = _config("attention_bwd_delta", q)
    dkdv_cfg = dkdv_config or _config("attention_bwd_dkdv", q)
    dq_cfg = dq_config or _config("attention_bwd_dq", q)
    delta = torch.empty((batch, heads, seq), dtype=torch.float32, device=q.device)
    _attention_bwd_delta_kernel[(triton.cdiv(seq, delta_cfg["BLOCK_M"]), batch * heads)](
        out, dout, delta, seq, heads, *_strides(out), *_strides(dout),
        BLOCK_M=delta_cfg["BLOCK_M"], HEAD_DIM=dim,
        num_warps=delta_cfg.num_warps, num_stages=delta_cfg.num_stages,
    )
    dq = torch.empty((batch, seq, heads, dim), dtype=q.dtype, device=q.device)
    dk = torch.empty_like(dq)
    dv = torch.empty_like(dq)
    common = (seq, heads, scale * LOG2E, scale, *_strides(q), *_strides(k), *_strides(v), *_strides(dout))
    _attention_bwd_dkdv_kernel[(triton.cdiv(seq, dkdv_cfg["BLOCK_N"]), batch * heads)](
        q, k, v, dout, lse2, delta, dk, dv, *common, *_strides(dk),
        BLOCK_M=dkdv_cfg["BLOCK_M"], BLOCK_N=dkdv_cfg["BLOCK_N"], HEAD_DIM=dim, UPCAST=upcast,
        num_warps=dkdv_cfg.num_warps, num_stages=dkdv_cfg.num_stages,
    )
    _attention_bwd_dq_kernel[(triton.cdiv(seq, dq_cfg["BLOCK_M"]), batch * heads)](
        q, k, v, dout, lse2, delta, dq, *common, *_strides(dq),
        BLOCK_M=dq_cfg["BLOCK_M"], BLOCK_N=dq_cfg["BLOCK_N"], HEAD_DIM=dim, UPCAST=upcast,
        num_warps=dq_cfg.num_warps, num_stages=dq_cfg.num_stages,
    )
    return dq, dk, dv


@torch.library.custom_op("flowlock::attention_fwd", mutates_args=())
def _attention_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward as one opaque op, so torch.compile and CUDA graphs replay the same launch."""
    return attention_fwd(q, k, v, scale)


@_attention_fwd_op.register_fake
def _(q, k, v, scale):
    batch, seq, heads, dim = q.shape
    return q.new_empty((batch, seq, heads, dim)), q.new_empty((batch, heads, seq), dtype=torch.float32)


@torch.library.custom_op("flowlock::attention_bwd", mutates_args=())
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
        out, lse2 = (_attention_fwd_op if traced() else attention_fwd)(q, k, v, scale)
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
