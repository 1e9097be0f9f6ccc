"""Triton kernels, launchers and autograd for ``linear``.

All three products of a linear layer are one GEMM ``C[i, j] = sum_r A[i, r] * B[r, j]``:

========  =========  ==========  =============  ==================================
product   i (rows)   j (cols)    r (reduced)    operands as stored
========  =========  ==========  =============  ==================================
forward   tokens M   outputs N   inputs K       A = x (M, K), B^T = weight (N, K)
dX        tokens M   inputs K    outputs N      A = dY (M, N), B = weight (N, K)
dW        outputs N  inputs K    tokens M       A^T = dY (M, N), B = x (M, K)
========  =========  ==========  =============  ==================================

Every output element accumulates from zero, ascending over the reduced dimension in blocks of
``BLOCK_R`` (bf16 / fp16: ``acc = tl.dot(a, b, acc)``; an fp32 operand: each block's true-fp32 dot
from zero, folded into the sum with a Kahan step, ``flowlock.ops._dot.add_compensated``);
out-of-range operand elements are zero on every path. Its bits
therefore depend only on its own A row, B column and ``BLOCK_R``, never on the tile that holds it,
the grid, M, N or how columns are fused or sharded. ``BLOCK_R`` comes from ``flowlock.config`` and
depends on dtype and architecture only.

dW reduces over tokens in fixed *token units* of ``UNIT`` rows (a multiple of ``BLOCK_R``): each
unit is summed from zero into a fresh float32 accumulator and the unit sums are folded left,
ascending, into the running total; the total is rounded once. A rank holding whole units can
compute its unit sums alone and a left fold of all units reproduces the single-GPU bits, which is
what sequence parallelism needs. dBias uses the same units.

Two kernel variants share these semantics; the launch config names the one to use (``TMA``):
``_linear_gemm_tma_kernel`` (Hopper: TMA tensor descriptors, persistent grid with a fixed grouped
tile order) and ``_linear_gemm_kernel`` (plain masked ``tl.load``, any GPU and the interpreter). A TMA
config with ``GLUON`` runs the forward and dX in 16-bit floats on the warp-specialized Gluon kernel of
:mod:`flowlock.ops.linear.gluon` instead: the same tiles, walk and bits (:func:`_gemm_gluon`).
The TMA variant may run the last, partial round of its walk as half-width tiles (``TAIL_SPLIT``):
at M = 925 the dX of q, k, v and fc1 is 168 tiles of 128 x 256 on 132 SMs, whose second round
would leave 96 SMs idle for a whole tile's time. ``STREAM_K`` (a sweep candidate, in no frozen
config) shares such a launch's BLOCK_R steps out evenly instead, a cut tile's fp32 accumulator
handed to the next program to continue the same chain, so it too keeps every element's bits.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from flowlock.config import LaunchConfig, config_for
from flowlock.dispatch import interpreter_active
from flowlock.ops._dot import add_compensated, dot_f32
from flowlock.ops._kernel_op import kernel_op
from flowlock.ops._launch import DescriptorLaunch, PlanTable, fast_launch, launch_hooked
from flowlock.ops._triton_utils import traced
from flowlock.ops._turns import pass_turn, take_ticket, wait_turn
from flowlock.ops.linear import gluon as gluon_gemm
from flowlock.ops.linear import gluon_stream
from flowlock.ops.linear.tile_order import split_tail, tile_coords

# Programs of the persistent TMA kernel under the interpreter: small, so the persistent loop really
# walks several tiles per program in CPU tests.
_INTERP_PROGRAMS = 3

# Prepared TMA GEMM launches (see _gemm_tma): one per linear layer shape, product and token count in use.
_TMA_PLANS = PlanTable(1024)


@triton.jit
def _mma(a, b, acc, comp, FP32_DOT: tl.constexpr, COMPENSATED: tl.constexpr):
    """``(acc, comp)`` after adding the block product ``a @ b``.

    FP32_DOT: the product in fp32 through ``dot_f32`` (an fp32 or mixed operand, or the interpreter,
    which computes bf16 dots wrongly; bf16 and fp16 products are exact in fp32). COMPENSATED (an fp32
    operand): the block is folded in with a Kahan step. The true-fp32 dot is an FMA chain on the GPU
    and a plain ``acc + dot`` is combined back into one chain over all of R (error growing with R:
    2.5x cuBLAS's fp32 dX error at R = 7168 on an H200); the compensated fold keeps the error at one
    BLOCK_R block's whatever R is. ``comp`` is untouched otherwise.
    """
    if COMPENSATED:
        return add_compensated(acc, comp, dot_f32(a.to(tl.float32), b.to(tl.float32)))
    elif FP32_DOT:
        return acc + dot_f32(a.to(tl.float32), b.to(tl.float32)), comp
    else:
        return tl.dot(a, b, acc), comp


@triton.jit
def _to_out(acc, OUT_DTYPE: tl.constexpr, SOFT_BF16: tl.constexpr):
    """Round the fp32 accumulator to the output dtype, to nearest even. SOFT_BF16 (interpreter
    only, whose fp32 -> bf16 cast truncates) does the same rounding with integer ops."""
    if SOFT_BF16:
        bits = acc.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(acc != acc, 0x7FC0, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return acc.to(OUT_DTYPE)


@triton.jit
def _ptr_dot_range(a_ptr, b_ptr, offs_i, offs_j, I, J, lo, hi, stride_ai, stride_ar, stride_br, stride_bj,
                   acc, BLOCK_R: tl.constexpr, FP32_DOT: tl.constexpr, COMPENSATED: tl.constexpr):
    """acc + A[offs_i, lo:hi] @ B[lo:hi, offs_j], ascending in BLOCK_R steps (compensated over the range)."""
    mask_i = offs_i < I
    mask_j = offs_j < J
    comp = tl.zeros_like(acc)
    for r0 in range(lo, hi, BLOCK_R):
        offs_r = (r0 + tl.arange(0, BLOCK_R)).to(tl.int64)
        mask_r = offs_r < hi
        a = tl.load(a_ptr + offs_i[:, None] * stride_ai + offs_r[None, :] * stride_ar,
                    mask=mask_i[:, None] & mask_r[None, :], other=0.0)
        b = tl.load(b_ptr + offs_r[:, None] * stride_br + offs_j[None, :] * stride_bj,
                    mask=mask_r[:, None] & mask_j[None, :], other=0.0)
        acc, comp = _mma(a, b, acc, comp, FP32_DOT, COMPENSATED)
    return acc


@fast_launch
@triton.jit
def _linear_gemm_kernel(a_ptr, b_ptr, bias_ptr, c_ptr, I, J, R,
                        stride_ai, stride_ar, stride_br, stride_bj, stride_ci, stride_cj,
                        HAS_BIAS: tl.constexpr, UNIT: tl.constexpr, FP32_DOT: tl.constexpr,
                        COMPENSATED: tl.constexpr, SOFT_BF16: tl.constexpr, BLOCK_I: tl.constexpr,
                        BLOCK_J: tl.constexpr, BLOCK_R: tl.constexpr, GROUP_I: tl.constexpr):
    """Pointer variant: one program per (BLOCK_I, BLOCK_J) output tile. UNIT == 0: one unit."""
    n_i = tl.cdiv(I, BLOCK_I)
    n_j = tl.cdiv(J, BLOCK_J)
    pid_i, pid_j = tile_coords(tl.program_id(0), n_i, n_j, GROUP_I)
    offs_i = (pid_i * BLOCK_I + tl.arange(0, BLOCK_I)).to(tl.int64)
    offs_j = (pid_j * BLOCK_J + tl.arange(0, BLOCK_J)).to(tl.int64)
    acc = tl.zeros((BLOCK_I, BLOCK_J), dtype=tl.float32)
    if UNIT == 0:
        acc = _ptr_dot_range(a_ptr, b_ptr, offs_i, offs_j, I, J, 0, R, stride_ai, stride_ar, stride_br,
                             stride_bj, acc, BLOCK_R, FP32_DOT, COMPENSATED)
    else:
        for u in range(0, R, UNIT):
            part = tl.zeros((BLOCK_I, BLOCK_J), dtype=tl.float32)
            part = _ptr_dot_range(a_ptr, b_ptr, offs_i, offs_j, I, J, u, tl.minimum(u + UNIT, R),
                                  stride_ai, stride_ar, stride_br, stride_bj, part, BLOCK_R, FP32_DOT,
                                  COMPENSATED)
            acc = acc + part
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_j, mask=offs_j < J, other=0.0)
        acc = acc + bias.to(tl.float32)[None, :]
    mask = (offs_i < I)[:, None] & (offs_j < J)[None, :]
    c_ptrs = c_ptr + offs_i[:, None] * stride_ci + offs_j[None, :] * stride_cj
    tl.store(c_ptrs, _to_out(acc, c_ptr.dtype.element_ty, SOFT_BF16), mask=mask)


@triton.jit
def _tma_dot_range(a_desc, b_desc, oi, oj, lo, hi, acc, A_T: tl.constexpr, B_T: tl.constexpr,
                   BLOCK_R: tl.constexpr, FP32_DOT: tl.constexpr, COMPENSATED: tl.constexpr):
    """acc + A[oi tile, lo:hi] @ B[lo:hi, oj tile] (compensated over the range); TMA zero-fills past
    the tensor's edge."""
    comp = tl.zeros_like(acc)
    for r0 in tl.range(lo, hi, BLOCK_R):
        if A_T:
            a = a_desc.load([r0, oi]).T
        else:
            a = a_desc.load([oi, r0])
        if B_T:
            b = b_desc.load([oj, r0]).T
        else:
            b = b_desc.load([r0, oj])
        acc, comp = _mma(a, b, acc, comp, FP32_DOT, COMPENSATED)
    return acc


@triton.jit
def _tma_dot_units_flat(a_desc, b_desc, oi, oj, R, acc, A_T: tl.constexpr, B_T: tl.constexpr,
                        BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_R: tl.constexpr,
                        UNIT: tl.constexpr, FP32_DOT: tl.constexpr, COMPENSATED: tl.constexpr):
    """The unit fold of _linear_gemm_tma_kernel as a single loop over BLOCK_R blocks: the same
    operations in the same order as the nested form, folding where a unit (or R) ends."""
    n_r = tl.cdiv(R, BLOCK_R)
    part = tl.zeros((BLOCK_I, BLOCK_J), dtype=tl.float32)
    comp = tl.zeros((BLOCK_I, BLOCK_J), dtype=tl.float32)
    for ri in tl.range(0, n_r):
        r0 = ri * BLOCK_R
        if A_T:
            a = a_desc.load([r0, oi]).T
        else:
            a = a_desc.load([oi, r0])
        if B_T:
            b = b_desc.load([oj, r0]).T
        else:
            b = b_desc.load([r0, oj])
        part, comp = _mma(a, b, part, comp, FP32_DOT, COMPENSATED)
        if ((ri + 1) % (UNIT // BLOCK_R) == 0) | (ri == n_r - 1):
            acc = acc + part
            part = tl.zeros((BLOCK_I, BLOCK_J), dtype=tl.float32)
            comp = tl.zeros((BLOCK_I, BLOCK_J), dtype=tl.float32)
    return acc


@triton.jit
def _tma_epilogue(acc, c_desc, bias_ptr, oi, oj, J, HAS_BIAS: tl.constexpr, SOFT_BF16: tl.constexpr,
                  EPI_SPLIT: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr):
    """Bias, one rounding and the store of the finished (BLOCK_I, BLOCK_J) tile at (oi, oj)."""
    if HAS_BIAS:
        offs_j = oj + tl.arange(0, BLOCK_J)
        bias = tl.load(bias_ptr + offs_j, mask=offs_j < J, other=0.0)
        acc = acc + bias.to(tl.float32)[None, :]
    c = _to_out(acc, c_desc.dtype, SOFT_BF16)
    if EPI_SPLIT:
        halves = tl.permute(tl.reshape(c, (BLOCK_I, 2, BLOCK_J // 2)), (0, 2, 1))
        c0, c1 = tl.split(halves)
        c_desc.store([oi, oj], c0)
        c_desc.store([oi, oj + BLOCK_J // 2], c1)
    else:
        c_desc.store([oi, oj], c)


@triton.jit
def _tma_tile(a_desc, b_desc, c_desc, bias_ptr, oi, oj, J, R, A_T: tl.constexpr, B_T: tl.constexpr,
              HAS_BIAS: tl.constexpr, UNIT: tl.constexpr, FP32_DOT: tl.constexpr, COMPENSATED: tl.constexpr,
              SOFT_BF16: tl.constexpr, EPI_SPLIT: tl.constexpr, FLAT_UNITS: tl.constexpr,
              BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_R: tl.constexpr):
    """One (BLOCK_I, BLOCK_J) output tile at (oi, oj): its reduction, bias and store."""
    acc = tl.zeros((BLOCK_I, BLOCK_J), dtype=tl.float32)
    if UNIT == 0:
        acc = _tma_dot_range(a_desc, b_desc, oi, oj, 0, R, acc, A_T, B_T, BLOCK_R, FP32_DOT, COMPENSATED)
    elif FLAT_UNITS:
        acc = _tma_dot_units_flat(a_desc, b_desc, oi, oj, R, acc, A_T, B_T, BLOCK_I, BLOCK_J, BLOCK_R, UNIT,
                                  FP32_DOT, COMPENSATED)
    else:
        for u in range(0, R, UNIT):
            part = tl.zeros((BLOCK_I, BLOCK_J), dtype=tl.float32)
            part = _tma_dot_range(a_desc, b_desc, oi, oj, u, tl.minimum(u + UNIT, R), part, A_T, B_T,
                                  BLOCK_R, FP32_DOT, COMPENSATED)
            acc = acc + part
    _tma_epilogue(acc, c_desc, bias_ptr, oi, oj, J, HAS_BIAS, SOFT_BF16, EPI_SPLIT, BLOCK_I, BLOCK_J)


@triton.jit
def _chain_slot(chain_ptr, slot, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr):
    """Pointers to the fp32 (BLOCK_I, BLOCK_J) accumulator slot ``slot`` of the chain workspace."""
    offs = tl.arange(0, BLOCK_I)[:, None] * BLOCK_J + tl.arange(0, BLOCK_J)[None, :]
    return chain_ptr + slot.to(tl.int64) * (BLOCK_I * BLOCK_J) + offs


@triton.jit
def _stream_k_share(a_desc, b_desc, c_desc, bias_ptr, chain_ptr, turns, program, tiles, n_i, n_j, J, R,
                    A_T: tl.constexpr, B_T: tl.constexpr, HAS_BIAS: tl.constexpr, FP32_DOT: tl.constexpr,
                    SOFT_BF16: tl.constexpr, EPI_SPLIT: tl.constexpr, BLOCK_I: tl.constexpr,
                    BLOCK_J: tl.constexpr, BLOCK_R: tl.constexpr, GROUP_I: tl.constexpr,
                    NUM_PROGRAMS: tl.constexpr):
    """This program's share of the launch's ``tiles`` tiles, stream-K.

    Their ``tiles * n_k`` BLOCK_R steps, tile after tile in the grouped order, are cut into
    NUM_PROGRAMS equal runs, one per program in ticket order; ``tiles >= NUM_PROGRAMS`` makes a run
    at least one tile long, so a tile is cut at most once. A cut tile's steps stay one accumulation chain: the
    program holding its first steps (the *head*) runs them from zero and publishes the fp32
    accumulator, and the next program continues the chain from exactly those values (the *tail*),
    then rounds and stores. The values pass through memory unchanged, so every element is the same
    chain of ``tl.dot`` steps as in a whole tile, and its bits do not depend on where the cut falls.
    The head runs first and the tail last, so the wait is for work the previous program started
    with (it already holds its ticket).
    """
    n_k = tl.cdiv(R, BLOCK_R)
    total = tiles * n_k
    start = (program * total) // NUM_PROGRAMS
    end = ((program + 1) * total) // NUM_PROGRAMS
    first = start // n_k
    first_step = start - first * n_k
    last = (end - 1) // n_k
    last_steps = end - last * n_k
    if last_steps < n_k:
        pid_i, pid_j = tile_coords(last, n_i, n_j, GROUP_I)
        head = tl.zeros((BLOCK_I, BLOCK_J), dtype=tl.float32)
        head = _tma_dot_range(a_desc, b_desc, pid_i * BLOCK_I, pid_j * BLOCK_J, 0, last_steps * BLOCK_R, head,
                              A_T, B_T, BLOCK_R, FP32_DOT, False)
        tl.store(_chain_slot(chain_ptr, program, BLOCK_I, BLOCK_J), head)
        pass_turn(turns + 1 + program, 1)
    whole_hi = tl.where(last_steps < n_k, last, last + 1)
    for t in tl.range(first + (first_step > 0), whole_hi):
        pid_i, pid_j = tile_coords(t, n_i, n_j, GROUP_I)
        _tma_tile(a_desc, b_desc, c_desc, bias_ptr, pid_i * BLOCK_I, pid_j * BLOCK_J, J, R, A_T, B_T, HAS_BIAS,
                  0, FP32_DOT, False, SOFT_BF16, EPI_SPLIT, False, BLOCK_I, BLOCK_J, BLOCK_R)
    if first_step > 0:
        pid_i, pid_j = tile_coords(first, n_i, n_j, GROUP_I)
        # the slot's address depends on the value the wait returns (1), so it is read after the turn
        slot = program - 2 + wait_turn(turns + program, 1)
        acc = tl.load(_chain_slot(chain_ptr, slot, BLOCK_I, BLOCK_J))
        acc = _tma_dot_range(a_desc, b_desc, pid_i * BLOCK_I, pid_j * BLOCK_J, first_step * BLOCK_R, R, acc,
                             A_T, B_T, BLOCK_R, FP32_DOT, False)
        _tma_epilogue(acc, c_desc, bias_ptr, pid_i * BLOCK_I, pid_j * BLOCK_J, J, HAS_BIAS, SOFT_BF16, EPI_SPLIT,
                      BLOCK_I, BLOCK_J)


@fast_launch
@triton.jit
def _linear_gemm_tma_kernel(a_desc, b_desc, c_desc, b_half_desc, c_half_desc, bias_ptr, chain_ptr, turns, I, J, R,
                            A_T: tl.constexpr, B_T: tl.constexpr, HAS_BIAS: tl.constexpr,
                            UNIT: tl.constexpr, FP32_DOT: tl.constexpr, COMPENSATED: tl.constexpr,
                            SOFT_BF16: tl.constexpr,
                            EPI_SPLIT: tl.constexpr, FLATTEN: tl.constexpr, FLAT_UNITS: tl.constexpr,
                            TAIL_SPLIT: tl.constexpr, STREAM_K: tl.constexpr,
                            BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_R: tl.constexpr,
                            GROUP_I: tl.constexpr, NUM_PROGRAMS: tl.constexpr):
    """TMA variant: persistent programs walk the grouped tile order with stride NUM_PROGRAMS.

    Descriptor blocks: A is (BLOCK_I, BLOCK_R), or (BLOCK_R, BLOCK_I) when stored transposed
    (A_T); B is (BLOCK_R, BLOCK_J), or (BLOCK_J, BLOCK_R) when B_T; C is (BLOCK_I, BLOCK_J), or
    (BLOCK_I, BLOCK_J // 2) with EPI_SPLIT, which stores the tile in two halves to halve the
    epilogue's shared memory. ``b_half_desc`` and ``c_half_desc`` are B and C with BLOCK_J // 2 in
    place of BLOCK_J, for the split tail. FLATTEN lets the compiler pipeline across tile boundaries
    and FLAT_UNITS runs the token units as one loop (no pipeline drain at unit boundaries).

    TAIL_SPLIT: when the walk's last round would leave most programs idle (tail tiles t with
    2 t <= NUM_PROGRAMS), those t tiles run as 2 t half-width tiles, one per program, so the round
    takes about half a tile's time.

    STREAM_K (one unit, no compensation; the launcher sets it only for one round plus a tail of at
    most half a round, :func:`streams_k`): in place of the walk, all tiles are shared out in equal runs
    of BLOCK_R steps (:func:`_stream_k_share`), so every program ends at the same time. Programs take
    their index from the ticket ``turns[0]``; ``turns[1 + p]`` says program p's head accumulator is in
    slot p of the fp32 workspace ``chain_ptr`` (NUM_PROGRAMS, BLOCK_I, BLOCK_J). Both start zeroed.

    None of these moves any arithmetic: an element's bits depend only on its row of A, its column of
    B and BLOCK_R, not on the tile or program that holds it or where its chain is cut.
    """
    n_i = tl.cdiv(I, BLOCK_I)
    n_j = tl.cdiv(J, BLOCK_J)
    tiles = n_i * n_j
    if STREAM_K:
        _stream_k_share(a_desc, b_desc, c_desc, bias_ptr, chain_ptr, turns, take_ticket(turns), tiles, n_i, n_j,
                        J, R, A_T, B_T, HAS_BIAS, FP32_DOT, SOFT_BF16, EPI_SPLIT, BLOCK_I, BLOCK_J, BLOCK_R,
                        GROUP_I, NUM_PROGRAMS)
    else:
        tail = split_tail(tiles, NUM_PROGRAMS, TAIL_SPLIT)
        for tile in tl.range(tl.program_id(0), tiles - tail, NUM_PROGRAMS, flatten=FLATTEN):
            pid_i, pid_j = tile_coords(tile, n_i, n_j, GROUP_I)
            _tma_tile(a_desc, b_desc, c_desc, bias_ptr, pid_i * BLOCK_I, pid_j * BLOCK_J, J, R, A_T, B_T,
                      HAS_BIAS, UNIT, FP32_DOT, COMPENSATED, SOFT_BF16, EPI_SPLIT, FLAT_UNITS, BLOCK_I, BLOCK_J,
                      BLOCK_R)
        if TAIL_SPLIT:
            for half in tl.range(tl.program_id(0), 2 * tail, NUM_PROGRAMS):
                pid_i, pid_j = tile_coords(tiles - tail + half // 2, n_i, n_j, GROUP_I)
                oj = pid_j * BLOCK_J + (half % 2) * (BLOCK_J // 2)
                if oj < J:  # the right half of the last column tile may lie wholly past J
                    _tma_tile(a_desc, b_half_desc, c_half_desc, bias_ptr, pid_i * BLOCK_I, oj, J, R, A_T, B_T,
                              HAS_BIAS, UNIT, FP32_DOT, COMPENSATED, SOFT_BF16, False, FLAT_UNITS, BLOCK_I,
                              BLOCK_J // 2, BLOCK_R)


@fast_launch
@triton.jit
def _linear_dbias_kernel(dy_ptr, db_ptr, M, N, stride_m, UNIT: tl.constexpr, SOFT_BF16: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """dBias[n] = sum_m dY[m, n]: BLOCK_R-row tiles summed into a fresh fp32 unit accumulator,
    unit sums folded left over UNIT-row units, one rounding."""
    offs_n = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask_n = offs_n < N
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for u in range(0, M, UNIT):
        part = tl.zeros((BLOCK_N,), dtype=tl.float32)
        hi = tl.minimum(u + UNIT, M)
        for r0 in range(u, hi, BLOCK_R):
            offs_r = (r0 + tl.arange(0, BLOCK_R)).to(tl.int64)
            tile = tl.load(dy_ptr + offs_r[:, None] * stride_m + offs_n[None, :],
                           mask=(offs_r < hi)[:, None] & mask_n[None, :], other=0.0)
            part = part + tl.sum(tile.to(tl.float32), axis=0)
        total = total + part
    tl.store(db_ptr + offs_n, _to_out(total, db_ptr.dtype.element_ty, SOFT_BF16), mask=mask_n)


@functools.cache
def _num_programs(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _config_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """Configs are keyed by bf16 / fp16 only when every operand has that dtype; fp32 or mixed operands
    use the fp32 ones (they run the fp32 dot)."""
    first = tensors[0].dtype
    for t in tensors:
        if t.dtype != first:
            return torch.float32
    return first


@functools.cache
def _alignment_error(n: int, k: int, operand_dtypes: tuple[torch.dtype, ...]) -> str | None:
    for dt in operand_dtypes:
        per16 = 16 // dt.itemsize
        if n % per16 or k % per16:
            return f"the TMA kernel needs N and K to be multiples of {per16} for {dt}, got N={n} K={k}"
    return None


def tma_alignment_error(weight: torch.Tensor, operand_dtypes: tuple[torch.dtype, ...]) -> str | None:
    """Why the TMA variant cannot serve this weight shape (row strides must be 16-byte multiples),
    or None. Checked by the API before launch; the launcher copies misaligned activations."""
    n, k = weight.shape
    return _alignment_error(n, k, operand_dtypes)


def lookup(op: str, weight: torch.Tensor, *operands: torch.Tensor) -> LaunchConfig:
    """The frozen config of ``op`` for this weight shape and these operands (memoized)."""
    return config_for(op, weight, tuple(weight.shape), _config_dtype(*operands))


def _chain_workspace(c: torch.Tensor, programs: int, cfg: LaunchConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """A stream-K launch's fp32 head accumulators, one (BLOCK_I, BLOCK_J) slot per program, and its
    int32 ticket and turn flags, zeroed. Fresh per launch from the current stream's allocator, so
    launches on different streams (dW beside dX) or replayed in CUDA graphs never share one."""
    chain = torch.empty((programs, cfg["BLOCK_I"], cfg["BLOCK_J"]), dtype=torch.float32, device=c.device)
    return chain, torch.zeros((1 + programs,), dtype=torch.int32, device=c.device)


def _tma_ready(t: torch.Tensor) -> torch.Tensor:
    if t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0:
        return t
    return t.contiguous() if not t.is_contiguous() else t.clone()


@functools.cache
def _tma_flags(cfg: LaunchConfig) -> tuple[bool, ...]:
    """``(EPI_SPLIT, FLATTEN, FLAT_UNITS, TAIL_SPLIT, PER_TILE, STREAM_K)`` of a TMA config, each
    optional (absent: off)."""
    blocks = dict(cfg.blocks)
    return tuple(bool(blocks.get(name, 0)) for name in ("EPI_SPLIT", "FLATTEN", "FLAT_UNITS", "TAIL_SPLIT",
                                                         "PER_TILE", "STREAM_K"))


def streams_k(stream_k: bool, unit: int, compensated: bool, tiles: int, programs: int) -> bool:
    """Whether a TMA launch shares its tiles out stream-K: the config asks for it, the reduction is one
    chain (no token units, no compensation term to carry), and the tiles are one round of the programs
    plus a tail of at most half a round, where the walk's second round would leave half the SMs or
    more idle (TAIL_SPLIT's half-width tiles take about 0.55 of a round there). Decided from tile
    counts, like the grid; the bits are those of the plain walk either way.

    Not for more tiles (H200, same process, queued; ``bench_linear.py --variant STREAM_K=1``): sharing a cut
    tile's steps between two programs staggers where in K the programs are, so the 8 row tiles of an
    M = 925 product stop reading each weight panel together and the weight streams from DRAM several
    times. 168 tiles (tail 36: dX of q and fc1 at M = 925) ran 0.93 and 0.87 of the split-tail walk;
    224 (tail 92) 1.15, and the last rounds of longer walks 1.00-1.35."""
    return (stream_k and unit == 0 and not compensated and programs < tiles
            and 2 * (tiles - programs) <= programs)


def tma_programs(tiles: int, processors: int, tail_split: bool, per_tile: bool) -> int:
    """Programs of the TMA walk for ``tiles`` output tiles on ``processors`` SMs. Persistent: one per
    SM, or one per tile when there are fewer, or one per half tile when TAIL_SPLIT halves them all
    within one round (the kernel's ``split_tail`` then takes every tile as the tail). PER_TILE: one
    per tile, which the GPU schedules onto SMs as they free up (a product running beside another)."""
    if per_tile:
        return tiles
    if tiles >= processors:
        return processors
    return 2 * tiles if tail_split and 2 * tiles <= processors else tiles


def _gemm(a: torch.Tensor, a_t: bool, b: torch.Tensor, b_t: bool, c: torch.Tensor, bias: torch.Tensor | None,
          cfg: LaunchConfig) -> torch.Tensor:
    """Launch ``c = A @ B (+ bias)`` with A stored as ``a`` (transposed when ``a_t``) and B stored
    as ``b`` (transposed when ``b_t``); all 2-D with unit last stride."""
    if cfg["TMA"]:
        if gluon_gemm.applies(cfg, a, a_t, b, c) and not interpreter_active():
            return _gemm_gluon(_tma_ready(a), _tma_ready(b), b_t, c, bias, cfg)
        return _gemm_tma(_tma_ready(a), a_t, _tma_ready(b), b_t, c, bias, cfg)
    i_dim, j_dim = c.shape
    r_dim = a.shape[0] if a_t else a.shape[1]
    fp32_dot, compensated, soft_bf16 = _arithmetic(a, b, c)
    bi, bj = cfg["BLOCK_I"], cfg["BLOCK_J"]
    s_ai, s_ar = (a.stride(1), a.stride(0)) if a_t else (a.stride(0), a.stride(1))
    s_br, s_bj = (b.stride(1), b.stride(0)) if b_t else (b.stride(0), b.stride(1))
    _linear_gemm_kernel[((-(-i_dim // bi)) * (-(-j_dim // bj)),)](
        a, b, bias if bias is not None else c, c, i_dim, j_dim, r_dim,
        s_ai, s_ar, s_br, s_bj, c.stride(0), c.stride(1),
        HAS_BIAS=bias is not None, UNIT=cfg["UNIT"], FP32_DOT=fp32_dot, COMPENSATED=compensated,
        SOFT_BF16=soft_bf16,
        BLOCK_I=bi, BLOCK_J=bj, BLOCK_R=cfg["BLOCK_R"], GROUP_I=cfg["GROUP_I"],
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return c


def _arithmetic(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> tuple[bool, bool, bool]:
    """``(FP32_DOT, COMPENSATED, SOFT_BF16)`` for these operands and this output."""
    interpreted = interpreter_active()
    compensated = a.dtype != b.dtype or a.dtype == torch.float32
    return interpreted or compensated, compensated, interpreted and c.dtype == torch.bfloat16


def _gemm_tma(a: torch.Tensor, a_t: bool, b: torch.Tensor, b_t: bool, c: torch.Tensor, bias: torch.Tensor | None,
              cfg: LaunchConfig) -> torch.Tensor:
    """The TMA variant of :func:`_gemm`, operands already TMA-ready.

    On a GPU the first launch of each (config, operand dtypes, shapes, strides, bias) goes through
    Triton and keeps its prepared launch; later ones relaunch it with the new tensors. The key fixes
    every value Triton specializes on (the sizes exactly; every pointer is 16-byte aligned but the
    bias, whose alignment is in the key), so the relaunch runs the kernel Triton would pick, and the
    persistent grid is the same function of the shapes.
    """
    i_dim, j_dim = c.shape
    r_dim = a.shape[0] if a_t else a.shape[1]
    bias_arg = bias if bias is not None else c
    key = None
    if c.is_cuda:
        key = (cfg, a_t, b_t, bias is None, a.dtype, b.dtype, c.dtype, bias_arg.dtype, bias_arg.data_ptr() % 16 == 0,
               a.shape, a.stride(), b.shape, b.stride(), c.shape, c.stride(), torch._C._cuda_getDevice())
        plan = _TMA_PLANS.get(key)
        if plan is not None and not launch_hooked():
            launch, programs, stream_k = plan
            chain, turns = _chain_workspace(c, programs, cfg) if stream_k else (c, c)
            launch(programs, torch._C._cuda_getCurrentRawStream(key[-1]), a, b, c, b, c, bias_arg, chain, turns,
                   i_dim, j_dim, r_dim)
            return c
    fp32_dot, compensated, soft_bf16 = _arithmetic(a, b, c)
    bi, bj, br = cfg["BLOCK_I"], cfg["BLOCK_J"], cfg["BLOCK_R"]
    tiles = (-(-i_dim // bi)) * (-(-j_dim // bj))
    epi_split, flatten, flat_units, tail_split, per_tile, stream_k = _tma_flags(cfg)
    descriptors = (TensorDescriptor.from_tensor(a, [br, bi] if a_t else [bi, br]),
                   TensorDescriptor.from_tensor(b, [bj, br] if b_t else [br, bj]),
                   TensorDescriptor.from_tensor(c, [bi, bj // 2 if epi_split else bj]),
                   TensorDescriptor.from_tensor(b, [bj // 2, br] if b_t else [br, bj // 2]),
                   TensorDescriptor.from_tensor(c, [bi, bj // 2]))
    programs = tma_programs(tiles, _num_programs(c.device.index or 0) if c.is_cuda else _INTERP_PROGRAMS,
                            tail_split, per_tile)
    stream_k = streams_k(stream_k, cfg["UNIT"], compensated, tiles, programs)
    chain, turns = _chain_workspace(c, programs, cfg) if stream_k else (c, c)
    args = (*descriptors, bias_arg, chain, turns, i_dim, j_dim, r_dim)
    kwargs = dict(A_T=a_t, B_T=b_t, HAS_BIAS=bias is not None, UNIT=cfg["UNIT"], FP32_DOT=fp32_dot,
                  COMPENSATED=compensated, SOFT_BF16=soft_bf16, EPI_SPLIT=epi_split, FLATTEN=flatten,
                  FLAT_UNITS=flat_units, TAIL_SPLIT=tail_split, STREAM_K=stream_k, BLOCK_I=bi, BLOCK_J=bj, BLOCK_R=br,
                  GROUP_I=cfg["GROUP_I"], NUM_PROGRAMS=programs, num_warps=cfg.num_warps,
                  num_stages=cfg.num_stages)
    _linear_gemm_tma_kernel[(programs,)](*args, **kwargs)
    if key is not None:
        prepared = _linear_gemm_tma_kernel.prepared(*args, **kwargs)
        if isinstance(prepared, DescriptorLaunch):
            _TMA_PLANS.keep(key, (prepared, programs, stream_k))
    return c


def _gemm_gluon(a: torch.Tensor, b: torch.Tensor, b_t: bool, c: torch.Tensor, bias: torch.Tensor | None,
                cfg: LaunchConfig) -> torch.Tensor:
    """:func:`_gemm` on the warp-specialized Gluon kernel (:mod:`flowlock.ops.linear.gluon`): the same
    persistent grid and split tail as the TMA walk, so the same tiles and bits."""
    tiles = (-(-c.shape[0] // cfg["BLOCK_I"])) * (-(-c.shape[1] // cfg["BLOCK_J"]))
    epi_split, flatten, flat_units, tail_split, per_tile, stream_k = _tma_flags(cfg)
    if per_tile or stream_k:
        raise ValueError(f"linear: the Gluon kernel walks tiles persistently; config {cfg} asks for PER_TILE or "
                         "STREAM_K")
    processors = _num_programs(c.device.index or 0)
    if gluon_stream.applies(cfg, a, False, b, b_t, c, processors):
        return gluon_stream.forward(a, b, c, bias, cfg, processors)
    programs = tma_programs(tiles, processors, tail_split, False)
    return gluon_gemm.gemm(a, b, b_t, c, bias, cfg, programs, tail_split)


def linear_fwd(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
               config: LaunchConfig | None = None) -> torch.Tensor:
    """``x2d (M, K) @ weight (N, K).T + bias`` -> ``(M, N)`` in ``out_dtype``. Trusted inputs.
    ``config``: the frozen config the API already looked up, or a test's override; None looks it up."""
    m, n = x2d.shape[0], weight.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=x2d.device)
    if m == 0:
        return out
    cfg = config or lookup("linear_fwd", weight, x2d, weight)
    return _gemm(x2d, False, weight, True, out, bias, cfg)


def linear_dx(dy: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype,
              config: LaunchConfig | None = None) -> torch.Tensor:
    """``dy (M, N) @ weight (N, K)`` -> ``(M, K)`` in ``out_dtype``, reducing over N."""
    m, k = dy.shape[0], weight.shape[1]
    out = torch.empty((m, k), dtype=out_dtype, device=dy.device)
    if m == 0:
        return out
    cfg = config or lookup("linear_dx", weight, dy, weight)
    return _gemm(dy, False, weight, False, out, None, cfg)


def linear_dw(dy: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype,
              config: LaunchConfig | None = None) -> torch.Tensor:
    """``dy (M, N).T @ x2d (M, K)`` -> ``(N, K)`` in ``out_dtype``, folded over token units.
    ``weight`` only selects the config. M == 0 gives zeros without a launch."""
    n, k = weight.shape
    if dy.shape[0] == 0:
        return torch.zeros((n, k), dtype=out_dtype, device=dy.device)
    out = torch.empty((n, k), dtype=out_dtype, device=dy.device)
    cfg = config or lookup("linear_dw", weight, dy, x2d)
    return _gemm(dy, True, x2d, False, out, None, cfg)


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _SIDE_STREAMS.get(index)
    if stream is None:
        stream = _SIDE_STREAMS[index] = torch.cuda.Stream(index)
    return stream


# dW runs beside dX while dX's tiles fill at most this many rounds of the SMs, so the idle part of
# dX's last round is a large share of its time (H200, dX + dW beside / one after the other: 0.910-0.992
# at M = 925, where dX is 168-448 tiles); above it dX then the persistent dW walk is as fast or faster
# (0.999-1.012 at M = 4253 and 16384: one program per tile loses a little to the walk). A schedule
# decided from tile counts, like the persistent grid: both give the same bits
# (tests/ops/test_linear_schedule_gpu.py).
BESIDE_MAX_ROUNDS = 4


def runs_beside(dx_tiles: int, processors: int) -> bool:
    """Whether :func:`linear_dx_dw` runs dW beside a dX of ``dx_tiles`` tiles on ``processors`` SMs."""
    return dx_tiles <= BESIDE_MAX_ROUNDS * processors


@functools.cache
def _walking(cfg: LaunchConfig) -> LaunchConfig:
    """``cfg`` with PER_TILE off: the persistent walk (same kernel and bits)."""
    return cfg.with_blocks(PER_TILE=0)


def linear_dx_dw(dy: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor, dx_dtype: torch.dtype,
                 dw_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(linear_dx(dy, weight, dx_dtype), linear_dw(dy, x2d, weight, dw_dtype))``: the same kernels
    and bits, and on a GPU, when dW's config is PER_TILE and dX is few tiles (:func:`runs_beside`),
    run side by side.

    dX goes to the current stream as a persistent walk, dW to a side stream as one program per tile,
    so dW's tiles take the SMs that dX's last round leaves idle (at M = 925 dX of q / k / v and fc1 is
    168 tiles of 128 x 256 on 132 SMs); the current stream waits for dW before this returns. The two
    write separate outputs, so running them together moves no arithmetic. Both outputs are allocated
    on the current stream, and the inputs stay alive until it has waited, so no buffer is reused while
    the side stream reads it. A CUDA graph captures the fork and the join. With more dX tiles, dX then
    dW as the persistent walk, on the current stream.
    """
    cfg = lookup("linear_dw", weight, dy, x2d)
    if not dy.is_cuda or dy.shape[0] == 0 or not _tma_flags(cfg)[4]:
        return linear_dx(dy, weight, dx_dtype), linear_dw(dy, x2d, weight, dw_dtype, cfg)
    dx_cfg = lookup("linear_dx", weight, dy, weight)
    dx_tiles = (-(-dy.shape[0] // dx_cfg["BLOCK_I"])) * (-(-weight.shape[1] // dx_cfg["BLOCK_J"]))
    if not runs_beside(dx_tiles, _num_programs(dy.device.index or 0)):
        return linear_dx(dy, weight, dx_dtype, dx_cfg), linear_dw(dy, x2d, weight, dw_dtype, _walking(cfg))
    main = torch.cuda.current_stream(dy.device)
    side = _side_stream(dy.device)
    dw = torch.empty(weight.shape, dtype=dw_dtype, device=dy.device)
    side.wait_stream(main)
    dx = linear_dx(dy, weight, dx_dtype, dx_cfg)
    with torch.cuda.stream(side):
        _gemm(dy, True, x2d, False, dw, None, cfg)
    main.wait_stream(side)
    return dx, dw


def linear_dbias(dy: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype,
                 config: LaunchConfig | None = None) -> torch.Tensor:
    """``dy (M, N).sum(0)`` -> ``(N,)`` in ``out_dtype``, fp32 over the same token units as dW."""
    m, n = dy.shape
    if m == 0:
        return torch.zeros((n,), dtype=out_dtype, device=dy.device)
    out = torch.empty((n,), dtype=out_dtype, device=dy.device)
    cfg = config or lookup("linear_dbias", weight, dy)
    _linear_dbias_kernel[(-(-n // cfg["BLOCK_N"]),)](
        dy, out, m, n, dy.stride(0), UNIT=cfg["UNIT"], SOFT_BF16=interpreter_active() and out_dtype == torch.bfloat16,
        BLOCK_N=cfg["BLOCK_N"], BLOCK_R=cfg["BLOCK_R"], num_warps=cfg.num_warps)
    return out


@kernel_op("flowlock::linear_fwd")
def _linear_fwd_op(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """The forward as one opaque op, so torch.compile and CUDA graphs replay the same launch. It looks
    up the frozen config itself (a config is no op argument type): the one the API passes."""
    return linear_fwd(x2d, weight, bias, out_dtype)


@_linear_fwd_op.register_fake
def _(x2d, weight, bias, out_dtype):
    return x2d.new_empty((x2d.shape[0], weight.shape[0]), dtype=out_dtype)


@kernel_op("flowlock::linear_bwd_dx")
def _linear_bwd_dx_op(dy: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """dX as one opaque op (see :func:`linear_dx`)."""
    return linear_dx(dy, weight, out_dtype)


@_linear_bwd_dx_op.register_fake
def _(dy, weight, out_dtype):
    return dy.new_empty((dy.shape[0], weight.shape[1]), dtype=out_dtype)


@kernel_op("flowlock::linear_bwd_dw")
def _linear_bwd_dw_op(dy: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor,
                      out_dtype: torch.dtype) -> torch.Tensor:
    """dW as one opaque op (see :func:`linear_dw`)."""
    return linear_dw(dy, x2d, weight, out_dtype)


@_linear_bwd_dw_op.register_fake
def _(dy, x2d, weight, out_dtype):
    return weight.new_empty(weight.shape, dtype=out_dtype)


@kernel_op("flowlock::linear_bwd_dx_dw")
def _linear_bwd_dx_dw_op(dy: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor, dx_dtype: torch.dtype,
                         dw_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """dX and dW as one opaque op (see :func:`linear_dx_dw`)."""
    return linear_dx_dw(dy, x2d, weight, dx_dtype, dw_dtype)


@_linear_bwd_dx_dw_op.register_fake
def _(dy, x2d, weight, dx_dtype, dw_dtype):
    return dy.new_empty((dy.shape[0], weight.shape[1]), dtype=dx_dtype), weight.new_empty(weight.shape, dtype=dw_dtype)


@kernel_op("flowlock::linear_bwd_dbias")
def _linear_bwd_dbias_op(dy: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """dBias as one opaque op (see :func:`linear_dbias`)."""
    return linear_dbias(dy, weight, out_dtype)


@_linear_bwd_dbias_op.register_fake
def _(dy, weight, out_dtype):
    return weight.new_empty((weight.shape[0],), dtype=out_dtype)


def linear_forward(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
                   config: LaunchConfig) -> torch.Tensor:
    """The forward as every path runs it: the registered custom op while tracing (which looks up the
    same frozen config), else the launcher with ``config``."""
    if traced():
        return _linear_fwd_op(x2d, weight, bias, out_dtype)
    return linear_fwd(x2d, weight, bias, out_dtype, config)


class LinearFunction(torch.autograd.Function):
    """Autograd node over 2-D operands: forward, dX, dW and dBias all via the kernels above."""

    @staticmethod
    def forward(ctx, x2d, weight, bias, out_dtype, config):
        ctx.save_for_backward(x2d, weight)
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return linear_forward(x2d, weight, bias, out_dtype, config)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x2d, weight = ctx.saved_tensors
        dy = dy.contiguous()
        dx = dw = db = None
        if traced():
            dx_fn, dw_fn, db_fn = _linear_bwd_dx_op, _linear_bwd_dw_op, _linear_bwd_dbias_op
            dx_dw_fn = _linear_bwd_dx_dw_op
        else:
            dx_fn, dw_fn, db_fn, dx_dw_fn = linear_dx, linear_dw, linear_dbias, linear_dx_dw
        if ctx.needs_input_grad[0] and ctx.needs_input_grad[1]:
            dx, dw = dx_dw_fn(dy, x2d, weight, x2d.dtype, weight.dtype)
        elif ctx.needs_input_grad[0]:
            dx = dx_fn(dy, weight, x2d.dtype)
        elif ctx.needs_input_grad[1]:
            dw = dw_fn(dy, x2d, weight, weight.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            db = db_fn(dy, weight, ctx.bias_dtype)
        return dx, dw, db, None, None
