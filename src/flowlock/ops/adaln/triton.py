"""Triton kernels, launchers and autograd nodes of the AdaLN projection and row gather.

The projection ``y = w(w(silu(temb)) @ W^T + b)``, ``w(.)`` rounding to the weight's dtype (bf16,
fp16, or fp32: no rounding), is the shared core of ``adaln_table`` (18H outputs) and
``final_adaln_out`` (2H outputs). PyTorch computes the FP32 SiLU; the kernels round it to the
weight's dtype themselves (the round-to-nearest-even of ``.to(weight.dtype)``), which saves a launch.
fp32 weights multiply in true fp32 (no TF32), each K tile folded in with a Kahan step. The
forward streams the weight once for up to 16 T rows; every output element is accumulated in FP32
over K in the same ascending tile order whatever T is, so a row's bits never depend on the other
rows. The backward never rounds the FP32 table gradient: ``d_act`` reduces over N through fixed
``CHUNK_N`` partials (each a Kahan-compensated sum of its BLOCK_N tiles) folded in ascending order,
a tile's product for bf16 weights on tensor cores from an exact three-part bf16 split of the fp32
gradient (compiled; interpreted, and for fp16 / fp32 weights, the true-fp32 product),
and ``dW``/``db`` sum the T rows in ascending order before one rounding to the weight's dtype. The
row gather's backward is in :mod:`flowlock.ops.adaln.table_grad`.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from flowlock.config import config_for, config_on
from flowlock.dispatch import interpreter_active
from flowlock.ops._dot import add_compensated, dot_f32
from flowlock.ops._fp_bits import from_f32, round_f32, to_f32
from flowlock.ops._kernel_op import kernel_op
from flowlock.ops._launch import fast_launch
from flowlock.ops._triton_utils import cdiv, traced
from flowlock.ops.adaln.table_grad import adaln_modulation_bwd


@fast_launch
@triton.jit(do_not_specialize=["T"])
def _adaln_table_fwd_kernel(act_ptr, w_ptr, b_ptr, out_ptr, T, N, E,
                            BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            UPCAST: tl.constexpr):
    # T is never specialized (no T == 1 or T % 16 == 0 variants): every T runs the same binary.
    pid_n = tl.program_id(0)
    pid_t = tl.program_id(1)
    offs_t = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask_t = offs_t < T
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    comp = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    dtype = w_ptr.dtype.element_ty
    for k0 in range(0, E, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K).to(tl.int64)
        mask_k = offs_k < E
        # The FP32 SiLU's one rounding to the weight's dtype (the identity on an activation in it).
        a = round_f32(to_f32(tl.load(act_ptr + offs_t[:, None] * E + offs_k[None, :],
                                     mask=mask_t[:, None] & mask_k[None, :], other=0.0)), dtype)
        w = tl.load(w_ptr + offs_n[None, :] * E + offs_k[:, None],
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if dtype == tl.float32:
            # True fp32: a plain += would be combined into one FMA chain over E (see flowlock.ops._dot).
            acc, comp = add_compensated(acc, comp, dot_f32(a, w))
        elif UPCAST:
            acc += dot_f32(a, to_f32(w))
        else:
            acc += tl.dot(from_f32(a, dtype), w)
    bias = to_f32(tl.load(b_ptr + offs_n, mask=mask_n, other=0.0))
    # One rounding after the bias, as nn.Linear's output in the weight's dtype; stored widened to FP32.
    y = round_f32(acc + bias[None, :], dtype)
    tl.store(out_ptr + offs_t[:, None] * N + offs_n[None, :], y, mask=mask_t[:, None] & mask_n[None, :])


@fast_launch
@triton.jit(do_not_specialize=["T"])
def _adaln_table_bwd_kernel(g_ptr, w_ptr, part_ptr, T, N, E,
                            BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            CHUNK_N: tl.constexpr, SPLIT: tl.constexpr):
    # Partial d_act over one fixed CHUNK_N slice of the N reduction: part[c, t, k].
    pid_c = tl.program_id(0)
    pid_t = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_t = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    offs_k = (pid_k * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)
    mask_t = offs_t < T
    mask_k = offs_k < E
    acc = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    comp = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    for n0 in range(0, CHUNK_N, BLOCK_N):
        offs_n = pid_c * CHUNK_N + n0 + tl.arange(0, BLOCK_N).to(tl.int64)
        mask_n = offs_n < N
        g = tl.load(g_ptr + offs_t[:, None] * N + offs_n[None, :],
                    mask=mask_t[:, None] & mask_n[None, :], other=0.0)
        w = tl.load(w_ptr + offs_n[:, None] * E + offs_k[None, :],
                    mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        if SPLIT:
            # bf16 weights on tensor cores: g = hi + mid + lo in three bf16 parts (each the rounding of
            # what the previous parts left, so the split is exact to ~2^-24 |g|); every product of a
            # part and a bf16 weight is exact in the fp32 accumulator.
            hi = g.to(tl.bfloat16)
            rest = g - hi.to(tl.float32)
            mid = rest.to(tl.bfloat16)
            lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
            part = tl.dot(lo, w, tl.dot(mid, w, tl.dot(hi, w, out_dtype=tl.float32)))
        else:
            # g is FP32 whatever the weight's dtype, so this is a true-fp32 dot (a plain += would be
            # combined into one FMA chain over the chunk, see flowlock.ops._dot).
            part = dot_f32(g, to_f32(w))
        # Tiles fold in with a Kahan step, ascending.
        acc, comp = add_compensated(acc, comp, part)
    base = pid_c.to(tl.int64) * T * E
    tl.store(part_ptr + base + offs_t[:, None] * E + offs_k[None, :], acc,
             mask=mask_t[:, None] & mask_k[None, :])


@fast_launch
@triton.jit
def _adaln_table_bwd_fold_kernel(part_ptr, temb_ptr, d_temb_ptr, TE, NUM_CHUNKS, BLOCK: tl.constexpr):
    # Fold the chunk partials in ascending order, then the FP32 SiLU VJP (the BF16 cast is
    # straight-through: its VJP is the identity, so d_act stays FP32).
    offs = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    mask = offs < TE
    d_act = tl.zeros((BLOCK,), dtype=tl.float32)
    for c in range(0, NUM_CHUNKS):
        d_act += tl.load(part_ptr + c * TE + offs, mask=mask, other=0.0)
    x = tl.load(temb_ptr + offs, mask=mask, other=0.0)
    sig = 1.0 / (1.0 + tl.exp(-x))
    tl.store(d_temb_ptr + offs, d_act * (sig * (1.0 + x * (1.0 - sig))), mask=mask)


@fast_launch
@triton.jit(do_not_specialize=["T"])
def _adaln_table_bwd_weight_kernel(g_ptr, act_ptr, dw_ptr, db_ptr, T, N, E,
                                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = (pid_k * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)
    mask_n = offs_n < N
    mask_k = offs_k < E
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_b = tl.zeros((BLOCK_N,), dtype=tl.float32)
    dtype = dw_ptr.dtype.element_ty
    # T rows summed one at a time in ascending order: the fold order is fixed by T alone.
    for t in range(0, T):
        g = tl.load(g_ptr + t * N + offs_n, mask=mask_n, other=0.0)
        a = round_f32(to_f32(tl.load(act_ptr + t * E + offs_k, mask=mask_k, other=0.0)), dtype)
        acc += g[:, None] * a[None, :]
        acc_b += g
    tl.store(dw_ptr + offs_n[:, None] * E + offs_k[None, :], from_f32(round_f32(acc, dtype), dtype),
             mask=mask_n[:, None] & mask_k[None, :])
    tl.store(db_ptr + offs_n, from_f32(round_f32(acc_b, dtype), dtype), mask=mask_n & (pid_k == 0))


@triton.jit
def _gather_chunk(table_ptr, rows, offs_s, offs_h, mask, out_ptr, H, ROW_STRIDE, C: tl.constexpr):
    vals = tl.load(table_ptr + rows[:, None] * ROW_STRIDE + C * H + offs_h[None, :], mask=mask, other=0.0)
    # The table holds values of the output dtype (the weight's), so narrowing is exact.
    tl.store(out_ptr + offs_s[:, None] * H + offs_h[None, :], from_f32(vals, out_ptr.dtype.element_ty), mask=mask)


@fast_launch
@triton.jit
def _adaln_modulation_fwd_kernel(table_ptr, ti_ptr, tag_ptr, out0_ptr, out1_ptr, out2_ptr, out3_ptr, out4_ptr,
                                 out5_ptr, S, H, ROW_STRIDE, BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr):
    # One launch for all six chunks: the indices are read once per row block, not once per chunk.
    offs_s = (tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)).to(tl.int64)
    offs_h = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
    mask_s = offs_s < S
    mask = mask_s[:, None] & (offs_h[None, :] < H)
    ti = tl.load(ti_ptr + offs_s, mask=mask_s, other=0).to(tl.int64)
    tag = tl.load(tag_ptr + offs_s, mask=mask_s, other=0).to(tl.int64)
    rows = ti * 3 + tag
    _gather_chunk(table_ptr, rows, offs_s, offs_h, mask, out0_ptr, H, ROW_STRIDE, 0)
    _gather_chunk(table_ptr, rows, offs_s, offs_h, mask, out1_ptr, H, ROW_STRIDE, 1)
    _gather_chunk(table_ptr, rows, offs_s, offs_h, mask, out2_ptr, H, ROW_STRIDE, 2)
    _gather_chunk(table_ptr, rows, offs_s, offs_h, mask, out3_ptr, H, ROW_STRIDE, 3)
    _gather_chunk(table_ptr, rows, offs_s, offs_h, mask, out4_ptr, H, ROW_STRIDE, 4)
    _gather_chunk(table_ptr, rows, offs_s, offs_h, mask, out5_ptr, H, ROW_STRIDE, 5)


def silu_act(temb: torch.Tensor) -> torch.Tensor:
    """``silu(temb)`` in FP32, with the PyTorch op diffusers uses; the kernels that read it round it
    to the weight's dtype once, giving diffusers' ``silu(temb).to(weight.dtype)`` activation.

    SiLU runs in FP32 (casting first changes ~52% of outputs) and is left to PyTorch's own kernel
    so the BF16 activation is bitwise the one the provider feeds its projection; a Triton ``exp``
    differs from it in the last FP32 bits and would occasionally flip a BF16 rounding.
    """
    return torch.nn.functional.silu(temb)


def adaln_table_fwd(act: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``(T, N)`` FP32 holding ``w(w(act) @ weight^T + bias)``, ``w`` rounding to the weight's dtype;
    act (T, E) fp32 (the SiLU output, rounded in the kernel) or of the weight's dtype, weight (N, E)
    bf16 / fp16 / fp32. Trusted: inputs are not validated."""
    t, e = act.shape
    n = weight.shape[0]
    block_n, block_t, kwargs = _table_fwd_args(weight.dtype, weight.device, interpreter_active())
    # Int sizes, not a tuple: the same tensor with less argument parsing.
    out = torch.empty(t, n, dtype=torch.float32, device=act.device)
    _adaln_table_fwd_kernel[(cdiv(n, block_n), cdiv(t, block_t))](act, weight, bias, out, t, n, e, **kwargs)
    return out


# Launch arguments derived from the frozen configs, read once per (dtype, device[, interpreter]) rather
# than field by field on every call.
@functools.cache
def _table_fwd_args(dtype: torch.dtype, device: torch.device, upcast: bool) -> tuple[int, int, dict]:
    """``(BLOCK_N, BLOCK_T, keyword arguments)`` of the projection forward."""
    cfg = config_on("adaln_proj_fwd", dtype, device)
    return cfg["BLOCK_N"], cfg["BLOCK_T"], dict(BLOCK_T=cfg["BLOCK_T"], BLOCK_N=cfg["BLOCK_N"],
                                                BLOCK_K=cfg["BLOCK_K"], UPCAST=upcast, num_warps=cfg.num_warps,
                                                num_stages=cfg.num_stages)


@functools.cache
def _gather_args(dtype: torch.dtype, device: torch.device) -> tuple[int, int, dict]:
    """``(BLOCK_S, BLOCK_H, keyword arguments)`` of the row gather."""
    cfg = config_on("adaln_gather", dtype, device)
    return cfg["BLOCK_S"], cfg["BLOCK_H"], dict(BLOCK_S=cfg["BLOCK_S"], BLOCK_H=cfg["BLOCK_H"],
                                                num_warps=cfg.num_warps)


def adaln_table_bwd(grad: torch.Tensor, temb: torch.Tensor, act: torch.Tensor, weight: torch.Tensor,
                    need_temb: bool = True, need_params: bool = True
                    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """VJP of the projection: grad (T, N) FP32 -> (d_temb (T, E) fp32, dW (N, E), db (N,) in the
    weight's dtype).

    ``act`` is the forward's activation input (fp32 SiLU or bf16, see :func:`adaln_table_fwd`).
    ``need_temb=False`` skips the pass that re-reads the weight (d_temb is None); ``need_params=False``
    skips dW and db (None), e.g. for a frozen projection.
    """
    grad = grad.contiguous()
    t, e = act.shape
    n = weight.shape[0]
    d_temb = d_weight = d_bias = None
    if need_temb:
        cfg = config_for("adaln_proj_bwd_act", weight)
        if cfg["CHUNK_N"] % cfg["BLOCK_N"]:
            # A chunk's inner loop would run into the next chunk and count those rows twice.
            raise ValueError(f"adaln_proj_bwd_act: CHUNK_N {cfg['CHUNK_N']} must be a multiple of BLOCK_N")
        chunks = cdiv(n, cfg["CHUNK_N"])
        partials = torch.empty((chunks, t, e), dtype=torch.float32, device=grad.device)
        grid = (chunks, cdiv(t, cfg["BLOCK_T"]), cdiv(e, cfg["BLOCK_K"]))
        # The interpreter keeps the BLAS-free fp32 product (flowlock.ops._dot): a host BLAS would sum it.
        split = weight.dtype == torch.bfloat16 and not interpreter_active()
        _adaln_table_bwd_kernel[grid](grad, weight, partials, t, n, e,
                                      BLOCK_T=cfg["BLOCK_T"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                                      CHUNK_N=cfg["CHUNK_N"], SPLIT=split, num_warps=cfg.num_warps,
                                      num_stages=cfg.num_stages)
        d_temb = torch.empty((t, e), dtype=torch.float32, device=grad.device)
        fold_block = 256
        _adaln_table_bwd_fold_kernel[(cdiv(t * e, fold_block),)](partials, temb, d_temb, t * e, chunks,
                                                                         BLOCK=fold_block)
    if need_params:
        wcfg = config_for("adaln_proj_bwd_weight", weight)
        d_weight = torch.empty((n, e), dtype=weight.dtype, device=grad.device)
        d_bias = torch.empty((n,), dtype=weight.dtype, device=grad.device)
        wgrid = (cdiv(n, wcfg["BLOCK_N"]), cdiv(e, wcfg["BLOCK_K"]))
        _adaln_table_bwd_weight_kernel[wgrid](grad, act, d_weight, d_bias, t, n, e,
                                              BLOCK_N=wcfg["BLOCK_N"], BLOCK_K=wcfg["BLOCK_K"],
                                              num_warps=wcfg.num_warps, num_stages=wcfg.num_stages)
    return d_temb, d_weight, d_bias


def adaln_modulation_fwd(projected: torch.Tensor, timestep_indices: torch.Tensor,
                         token_tags: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Six ``(S, H)`` tensors of ``dtype`` (the weight's, whose values the table holds)
    ``table[ti*3+tag, c*H:(c+1)*H]`` of the ``(3T, 6H)`` FP32 table, read from the contiguous
    ``(T, 18H)`` projection output it views (row stride ``6H``) without the view op."""
    s = timestep_indices.shape[0]
    h = projected.shape[1] // 18
    block_s, block_h, kwargs = _gather_args(projected.dtype, projected.device)
    device = projected.device
    # Int sizes, not a tuple: the same tensors with less argument parsing.
    outs = [torch.empty(s, h, dtype=dtype, device=device) for _ in range(6)]
    _adaln_modulation_fwd_kernel[(cdiv(s, block_s), cdiv(h, block_h))](
        projected, timestep_indices, token_tags, *outs, s, h, 6 * h, **kwargs)
    return tuple(outs)


@kernel_op("flowlock::adaln_table_fwd")
def _adaln_table_fwd_op(act: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The projection as one opaque op, so torch.compile and CUDA graphs replay the same launch."""
    return adaln_table_fwd(act, weight, bias)


@_adaln_table_fwd_op.register_fake
def _(act, weight, bias):
    return act.new_empty((act.shape[0], weight.shape[0]), dtype=torch.float32)


@kernel_op("flowlock::adaln_table_bwd_temb")
def _adaln_table_bwd_temb_op(grad: torch.Tensor, temb: torch.Tensor, act: torch.Tensor,
                             weight: torch.Tensor) -> torch.Tensor:
    """``d_temb`` of the projection (see :func:`adaln_table_bwd`)."""
    return adaln_table_bwd(grad, temb, act, weight, need_temb=True, need_params=False)[0]


@_adaln_table_bwd_temb_op.register_fake
def _(grad, temb, act, weight):
    return temb.new_empty(temb.shape)


@kernel_op("flowlock::adaln_table_bwd_params")
def _adaln_table_bwd_params_op(grad: torch.Tensor, temb: torch.Tensor, act: torch.Tensor,
                               weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dW, db)`` of the projection (see :func:`adaln_table_bwd`)."""
    _, d_weight, d_bias = adaln_table_bwd(grad, temb, act, weight, need_temb=False, need_params=True)
    return d_weight, d_bias


@_adaln_table_bwd_params_op.register_fake
def _(grad, temb, act, weight):
    return weight.new_empty(weight.shape), weight.new_empty((weight.shape[0],))


@kernel_op("flowlock::adaln_modulation_fwd")
def _adaln_modulation_fwd_op(projected: torch.Tensor, timestep_indices: torch.Tensor,
                             token_tags: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
    """The six-way row gather from the ``(T, 18H)`` projection output as one opaque op."""
    return list(adaln_modulation_fwd(projected, timestep_indices, token_tags, dtype))


@_adaln_modulation_fwd_op.register_fake
def _(projected, timestep_indices, token_tags, dtype):
    shape = (timestep_indices.shape[0], projected.shape[1] // 18)
    return [projected.new_empty(shape, dtype=dtype) for _ in range(6)]


@kernel_op("flowlock::adaln_modulation_bwd")
def _adaln_modulation_bwd_op(grads: list[torch.Tensor], timestep_indices: torch.Tensor, token_tags: torch.Tensor,
                             num_rows: int) -> torch.Tensor:
    """The segmented sum of the six row gradients as one opaque op."""
    return adaln_modulation_bwd(tuple(grads), timestep_indices, token_tags, num_rows)


@_adaln_modulation_bwd_op.register_fake
def _(grads, timestep_indices, token_tags, num_rows):
    return grads[0].new_empty((num_rows, 6 * grads[0].shape[1]), dtype=torch.float32)


def projection_vjp(grad: torch.Tensor, temb: torch.Tensor, act: torch.Tensor, weight: torch.Tensor,
                   need_temb: bool, need_params: bool
                   ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(d_temb, dW, db)``, ``None`` where not needed; through the custom ops when traced."""
    if not traced():
        return adaln_table_bwd(grad, temb, act, weight, need_temb=need_temb, need_params=need_params)
    d_temb = _adaln_table_bwd_temb_op(grad, temb, act, weight) if need_temb else None
    d_weight, d_bias = _adaln_table_bwd_params_op(grad, temb, act, weight) if need_params else (None, None)
    return d_temb, d_weight, d_bias


def projection(temb: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(act, table)``: the FP32 SiLU activation and the ``(T, N)`` FP32 table (through the custom op
    when traced)."""
    act = silu_act(temb)
    return act, (_adaln_table_fwd_op if traced() else adaln_table_fwd)(act, weight, bias)


def modulation_forward(temb: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, timestep_indices: torch.Tensor,
                       token_tags: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """``(act, six (S, H) rows in the weight's dtype)``: the launches of
    :class:`AdalnModulationFunction`'s forward, which a call that records no autograd node makes
    directly (same launchers, same bits)."""
    act = silu_act(temb)
    if traced():
        projected = _adaln_table_fwd_op(act, weight, bias)
        return act, tuple(_adaln_modulation_fwd_op(projected, timestep_indices, token_tags, weight.dtype))
    return act, adaln_modulation_fwd(adaln_table_fwd(act, weight, bias), timestep_indices, token_tags, weight.dtype)


class AdalnTableFunction(torch.autograd.Function):
    """One node: temb (T, E) fp32, weight (N, E) and bias (N,) bf16 / fp16 / fp32 -> (T, N) fp32 table."""

    @staticmethod
    def forward(ctx, temb, weight, bias):
        act, table = projection(temb, weight, bias)
        ctx.save_for_backward(temb, act, weight)
        return table

    @staticmethod
    def backward(ctx, grad):
        temb, act, weight = ctx.saved_tensors
        need = ctx.needs_input_grad
        return projection_vjp(grad.contiguous(), temb, act, weight, need[0], need[1] or need[2])


class AdalnTableKeptFunction(torch.autograd.Function):
    """:class:`AdalnTableFunction`'s node with its forward values given: temb (T, E), weight (N, E), bias (N,)
    and table (T, N) fp32, that node's output on them -> a view of ``table``, no projection
    launch. It saves what that node saves and runs the same backward on it, so every gradient is that
    node's, bit for bit."""

    @staticmethod
    def forward(ctx, temb, weight, bias, table):
        ctx.save_for_backward(temb, silu_act(temb), weight)
        return table

    @staticmethod
    def backward(ctx, grad):
        # The inputs come in AdalnTableFunction's order, so its backward reads the same needs.
        return *AdalnTableFunction.backward(ctx, grad), None


class AdalnModulationFunction(torch.autograd.Function):
    """One node: projection plus per-row gather; the FP32 table gradient never leaves the node."""

    @staticmethod
    def forward(ctx, temb, weight, bias, timestep_indices, token_tags):
        act, outs = modulation_forward(temb, weight, bias, timestep_indices, token_tags)
        ctx.save_for_backward(temb, act, weight, timestep_indices, token_tags)
        # An unused chunk's gradient arrives as None, not as a zero-filled (S, H) tensor: the table
        # gradient kernel writes its zero partials without reading anything.
        ctx.set_materialize_grads(False)
        return outs

    @staticmethod
    def backward(ctx, *grads):
        temb, act, weight, timestep_indices, token_tags = ctx.saved_tensors
        if all(g is None for g in grads):
            return None, None, None, None, None
        t = temb.shape[0]
        if traced():
            s, h = timestep_indices.shape[0], weight.shape[0] // 18
            grads = [g.contiguous() if g is not None else weight.new_zeros((s, h)) for g in grads]
            d_table = _adaln_modulation_bwd_op(grads, timestep_indices, token_tags, 3 * t)
        else:
            d_table = adaln_modulation_bwd(grads, timestep_indices, token_tags, 3 * t)
        need = ctx.needs_input_grad
        d_temb, d_weight, d_bias = projection_vjp(d_table.view(t, -1), temb, act, weight,
                                                  need[0], need[1] or need[2])
        return d_temb, d_weight, d_bias, None, None
