"""Triton kernels for the timestep path: the 256-channel sinusoid and the small-M FP32 MLP.

Sinusoid: one program per timestep; the only arithmetic before sin/cos is the float32 product
``t·f`` against diffusers' own frequency table, and sin/cos are CUDA's precise ``sinf``/``cosf``
(libdevice, the functions torch calls), so the result is bitwise diffusers' on the GPU. The
interpreter has no libdevice and uses numpy's sin/cos instead.

MLP: T is 1..8, so every layer is a GEMV: each program loads one ``[BLOCK_N, BLOCK_K]`` weight tile
once (coalesced along w's contiguous axis) and reduces it against each of the T rows in turn, with
no padded M tile and no ``tl.dot``. Each output element sums each fixed ``BLOCK_K`` slice of K with
one fixed in-tile tree, then the slices in ascending order, so it depends only on its own input row:
rows are pure.
Weight and bias gradients sum over the T rows in ascending order inside one program: no atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from flowlock.config import launch_config
from flowlock.dispatch import interpreter_active
from flowlock.ops._triton_utils import arch_of
from flowlock.ops.timestep.reference import HALF, sinusoid_freqs


@triton.jit
def _sin_cos(x, INTERPRET: tl.constexpr):
    if INTERPRET:
        return tl.sin(x), tl.cos(x)
    else:
        return libdevice.sin(x), libdevice.cos(x)


@triton.jit
def _exp(x, INTERPRET: tl.constexpr):
    if INTERPRET:
        return tl.exp(x)
    else:
        return libdevice.exp(x)


@triton.jit
def _timestep_sinusoid_fwd_kernel(t_ptr, f_ptr, out_ptr, HALF_C: tl.constexpr, INTERPRET: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, HALF_C)
    mask = k < HALF_C
    t = tl.load(t_ptr + row)
    arg = t * tl.load(f_ptr + k, mask=mask, other=0.0)
    s, c = _sin_cos(arg, INTERPRET)
    base = out_ptr + row * (2 * HALF_C)
    tl.store(base + k, c, mask=mask)
    tl.store(base + HALF_C + k, s, mask=mask)


@triton.jit
def _timestep_sinusoid_bwd_kernel(t_ptr, f_ptr, g_ptr, dt_ptr, HALF_C: tl.constexpr, LOG2_HALF: tl.constexpr,
                                  INTERPRET: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, HALF_C)
    mask = k < HALF_C
    t = tl.load(t_ptr + row)
    f = tl.load(f_ptr + k, mask=mask, other=0.0)
    s, c = _sin_cos(t * f, INTERPRET)
    g_cos = tl.load(g_ptr + row * (2 * HALF_C) + k, mask=mask, other=0.0)
    g_sin = tl.load(g_ptr + row * (2 * HALF_C) + HALF_C + k, mask=mask, other=0.0)
    # The 256 channel terms cancel heavily; in float32 their rounding made d t about 3x further from
    # FP64 than diffusers' (H200, T=1). Products and sum in float64, one rounding at the end, leave
    # only the float32 sin/cos values' own error.
    f64 = f.to(tl.float64)
    from_sin = f64 * (c.to(tl.float64) * g_sin.to(tl.float64))
    from_cos = f64 * (s.to(tl.float64) * g_cos.to(tl.float64))
    terms = from_sin - from_cos
    # Pairwise tree over the channels: each level adds neighbours (2i, 2i + 1), whatever the layout.
    for _ in tl.static_range(LOG2_HALF):
        left, right = tl.split(tl.reshape(terms, (terms.shape[0] // 2, 2)))
        terms = left + right
    tl.store(dt_ptr + row + tl.arange(0, 1), terms.to(tl.float32))


@triton.jit
def _gemv_epilogue(acc, bias_ptr, pre_ptr, out_ptr, offs, cols, mask, EPILOGUE: tl.constexpr,
                   INTERPRET: tl.constexpr):
    """0 adds ``bias`` (if given); 1 adds ``bias``, stores it to ``pre`` and writes ``silu``; 2 multiplies
    by ``silu'(pre)`` (the SiLU backward). ``acc`` is one row's ``BLOCK_N`` columns."""
    if bias_ptr is not None:
        acc = acc + tl.load(bias_ptr + cols, mask=mask, other=0.0)
    if EPILOGUE == 1:
        tl.store(pre_ptr + offs, acc, mask=mask)
        acc = tl.math.div_rn(acc, 1.0 + _exp(-acc, INTERPRET))
    elif EPILOGUE == 2:
        pre = tl.load(pre_ptr + offs, mask=mask, other=0.0)
        sig = tl.math.div_rn(1.0, 1.0 + _exp(-pre, INTERPRET))
        acc = acc * (sig * (1.0 + pre * (1.0 - sig)))
    tl.store(out_ptr + offs, acc, mask=mask)


@triton.jit
def _rows_gemv_kernel(a_ptr, w_ptr, bias_ptr, pre_ptr, out_ptr, part_ptr, M, N, K, stride_wn, stride_wk,
                      EPILOGUE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      SPLITS: tl.constexpr, INTERPRET: tl.constexpr):
    """``Σ_k a[m, k]·w[n, k]`` (a row-major ``(M, K)``, w by strides) over the ``BLOCK_K``-long K slice
    ``program_id(1)`` for every row m. The ``[BLOCK_N, BLOCK_K]`` weight tile is loaded once (the
    layout follows w's contiguous axis, so the load is coalesced either way) and held in registers
    while the rows stream past it: each row is one elementwise product and one ``tl.sum`` over the
    slice, the same code whatever M is. With one slice the epilogue follows directly; otherwise the
    slice's sum goes to ``part[slice, m, n]`` for :func:`_gemv_fold_kernel`."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    ks = split * BLOCK_K + tl.arange(0, BLOCK_K)
    col_mask = cols < N
    k_mask = ks < K
    cols64 = cols.to(tl.int64)
    w = tl.load(w_ptr + cols64[:, None] * stride_wn + ks.to(tl.int64)[None, :] * stride_wk,
                mask=col_mask[:, None] & k_mask[None, :], other=0.0)
    for m in range(0, M):
        row = tl.full((), 0, tl.int64) + m  # int64 so row * K and row * N cannot wrap
        a = tl.load(a_ptr + row * K + ks, mask=k_mask, other=0.0)
        acc = tl.sum(w * a[None, :], axis=1)
        offs = row * N + cols64
        if SPLITS == 1:
            _gemv_epilogue(acc, bias_ptr, pre_ptr, out_ptr, offs, cols, col_mask, EPILOGUE, INTERPRET)
        else:
            tl.store(part_ptr + split.to(tl.int64) * M * N + offs, acc, mask=col_mask)


@triton.jit
def _gemv_fold_kernel(part_ptr, bias_ptr, pre_ptr, out_ptr, M, N, EPILOGUE: tl.constexpr, BLOCK_N: tl.constexpr,
                      SPLITS: tl.constexpr, INTERPRET: tl.constexpr):
    """Fold row ``program_id(1)``'s K-slice sums in ascending slice order (a fixed order set by K
    alone), then the epilogue."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    offs = tl.program_id(1).to(tl.int64) * N + cols.to(tl.int64)
    acc = tl.load(part_ptr + offs, mask=col_mask, other=0.0)
    for split in range(1, SPLITS):
        acc = acc + tl.load(part_ptr + split * M * N + offs, mask=col_mask, other=0.0)
    _gemv_epilogue(acc, bias_ptr, pre_ptr, out_ptr, offs, cols, col_mask, EPILOGUE, INTERPRET)


@triton.jit
def _rows_wgrad_kernel(g_ptr, a_ptr, dw_ptr, db_ptr, M, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``dw[n, k] = Σ_m g[m, n]·a[m, k]`` and ``db[n] = Σ_m g[m, n]``, m ascending, one program per tile."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    col_mask = cols < N
    k_mask = ks < K
    acc_w = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_b = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for m in range(0, M):
        g = tl.load(g_ptr + m * N + cols, mask=col_mask, other=0.0)
        a = tl.load(a_ptr + m * K + ks, mask=k_mask, other=0.0)
        acc_w = acc_w + g[:, None] * a[None, :]
        acc_b = acc_b + g
    offs = cols.to(tl.int64)[:, None] * K + ks[None, :]
    tl.store(dw_ptr + offs, acc_w, mask=col_mask[:, None] & k_mask[None, :])
    tl.store(db_ptr + cols, acc_b, mask=col_mask & (tl.program_id(1) == 0))


def timestep_sinusoid_fwd(t: torch.Tensor) -> torch.Tensor:
    """Trusted launcher: ``(T,)`` float32 contiguous -> ``(T, 256)`` float32."""
    out = torch.empty((t.shape[0], 2 * HALF), dtype=torch.float32, device=t.device)
    if t.shape[0] == 0:
        return out
    cfg = launch_config("timestep_sinusoid", torch.float32, arch_of(t))
    _timestep_sinusoid_fwd_kernel[(t.shape[0],)](
        t, sinusoid_freqs(t.device), out, HALF_C=HALF, INTERPRET=interpreter_active(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_reflect_ftz=False)
    return out


def timestep_sinusoid_bwd(t: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Trusted launcher: ``d t = Σ_k f_k·(cos(t f_k)·g_sin_k − sin(t f_k)·g_cos_k)``, pairwise tree over k."""
    grad = grad.contiguous()
    dt = torch.empty_like(t)
    if t.shape[0] == 0:
        return dt
    cfg = launch_config("timestep_sinusoid", torch.float32, arch_of(t))
    _timestep_sinusoid_bwd_kernel[(t.shape[0],)](
        t, sinusoid_freqs(t.device), grad, dt, HALF_C=HALF, LOG2_HALF=HALF.bit_length() - 1,
        INTERPRET=interpreter_active(), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        enable_reflect_ftz=False)
    return dt


class TimestepSinusoidFunction(torch.autograd.Function):
    """Autograd boundary of ``timestep_sinusoid`` (gradient to ``t``)."""

    @staticmethod
    def forward(ctx, t):
        ctx.save_for_backward(t)
        return timestep_sinusoid_fwd(t)

    @staticmethod
    def backward(ctx, grad):
        (t,) = ctx.saved_tensors
        return timestep_sinusoid_bwd(t, grad)


def _gemv(a: torch.Tensor, w: torch.Tensor, stride_wn: int, stride_wk: int, n: int, bias: torch.Tensor | None,
          epilogue: int, pre: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    m, k = a.shape
    out = torch.empty((m, n), dtype=torch.float32, device=a.device)
    if epilogue == 1:
        pre = torch.empty_like(out)
    # A transposed read (w's N axis contiguous) wants a wide N tile, a direct one a wide K tile.
    cfg = launch_config("timestep_mlp_t" if stride_wn == 1 else "timestep_mlp", torch.float32, arch_of(a))
    # The K slice is the whole tile (a function of the config and K alone, never of T): each program
    # reads its weight tile once, and the slices are folded in ascending order.
    block_k = min(cfg["BLOCK_K"], triton.next_power_of_2(k))
    splits = triton.cdiv(k, block_k)
    part = torch.empty((splits, m, n), dtype=torch.float32, device=a.device) if splits > 1 else None
    interpret = interpreter_active()
    _rows_gemv_kernel[(triton.cdiv(n, cfg["BLOCK_N"]), splits)](
        a, w, bias, pre, out, part, m, n, k, stride_wn, stride_wk, EPILOGUE=epilogue, BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=block_k, SPLITS=splits, INTERPRET=interpret, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, enable_reflect_ftz=False)
    if splits > 1:
        _gemv_fold_kernel[(triton.cdiv(n, cfg["FOLD_N"]), m)](
            part, bias, pre, out, m, n, EPILOGUE=epilogue, BLOCK_N=cfg["FOLD_N"], SPLITS=splits,
            INTERPRET=interpret, num_warps=cfg.num_warps, enable_reflect_ftz=False)
    return out, pre


def _wgrad(g: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    (m, n), k = g.shape, a.shape[1]
    dw = torch.empty((n, k), dtype=torch.float32, device=g.device)
    db = torch.empty((n,), dtype=torch.float32, device=g.device)
    cfg = launch_config("timestep_mlp_wgrad", torch.float32, arch_of(g))
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(k, cfg["BLOCK_K"]))
    _rows_wgrad_kernel[grid](g, a, dw, db, m, n, k, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                             num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return dw, db


def timestep_mlp_fwd(x, w1, b1, w2, b2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Trusted launcher: returns ``(out (T, E), h (T, H) linear_1 output, act (T, H) SiLU output)``."""
    hidden, embed = w1.shape[0], w2.shape[0]
    act, h = _gemv(x, w1, w1.stride(0), w1.stride(1), hidden, b1, epilogue=1)
    out, _ = _gemv(act, w2, w2.stride(0), w2.stride(1), embed, b2, epilogue=0)
    return out, h, act


def timestep_mlp_bwd(grad, x, w1, w2, h, act, needs_dx: bool = True):
    """Trusted launcher: ``(dx or None, dw1, db1, dw2, db2)``; dx and dh rows are pure, weight and bias
    gradients sum the T rows in ascending order."""
    grad = grad.contiguous()
    dw2, db2 = _wgrad(grad, act)
    # d act = grad @ w2 (w2 read transposed: n = hidden index, k = embed index), then through SiLU.
    dh, _ = _gemv(grad, w2, w2.stride(1), w2.stride(0), w2.shape[1], None, epilogue=2, pre=h)
    dw1, db1 = _wgrad(dh, x)
    dx = _gemv(dh, w1, w1.stride(1), w1.stride(0), w1.shape[1], None, epilogue=0)[0] if needs_dx else None
    return dx, dw1, db1, dw2, db2


class TimestepMlpFunction(torch.autograd.Function):
    """Autograd boundary of ``timestep_mlp`` (gradients to x and every weight and bias)."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, b2):
        out, h, act = timestep_mlp_fwd(x, w1, b1, w2, b2)
        ctx.save_for_backward(x, w1, w2, h, act)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, w1, w2, h, act = ctx.saved_tensors
        return timestep_mlp_bwd(grad, x, w1, w2, h, act, needs_dx=ctx.needs_input_grad[0])
