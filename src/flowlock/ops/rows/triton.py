"""Triton row gather / row scatter: pure copies, so forward and backward are exact and repeatable.

One program copies one ``BLOCK_H`` slice of one row. The scatter runs over *destination* rows with
an owner map (which part, which row of it), so every output element is written exactly once (owned
rows from their part, uncovered rows as zeros) and no two programs touch the same element: no
atomics, no dependence on launch order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flowlock.config import config_for
from flowlock.ops._kernel_op import kernel_op
from flowlock.ops._launch import fast_launch
from flowlock.ops._triton_utils import traced
from flowlock.ops._validate import memoized_over


@fast_launch
@triton.jit
def _gather_rows_fwd_kernel(x_ptr, index_ptr, out_ptr, N, H, stride_xb, stride_xs, stride_ob, stride_on,
                            BLOCK_H: tl.constexpr):
    row = tl.program_id(0)
    b = (row // N).to(tl.int64)
    n = (row % N).to(tl.int64)
    src = tl.load(index_ptr + n).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    vals = tl.load(x_ptr + b * stride_xb + src * stride_xs + cols, mask=mask)
    tl.store(out_ptr + b * stride_ob + n * stride_on + cols, vals, mask=mask)


@fast_launch
@triton.jit
def _scatter_rows_fwd_kernel(part_ptr, owner_ptr, local_ptr, out_ptr, S, H, PART, stride_pb, stride_pn,
                             stride_ob, stride_os, WRITE_ZEROS: tl.constexpr, BLOCK_H: tl.constexpr):
    row = tl.program_id(0)
    b = (row // S).to(tl.int64)
    s = (row % S).to(tl.int64)
    owner = tl.load(owner_ptr + s)
    local = tl.load(local_ptr + s).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    mine = owner == PART
    vals = tl.load(part_ptr + b * stride_pb + local * stride_pn + cols, mask=mask & mine, other=0.0)
    if WRITE_ZEROS:
        write = mask & (mine | (owner < 0))
    else:
        write = mask & mine
    tl.store(out_ptr + b * stride_ob + s * stride_os + cols, vals, mask=write)


def gather_rows_fwd(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Trusted launcher: (B, S, H) with last dim contiguous, (N,) valid unique index -> (B, N, H)."""
    batch, _, hidden = x.shape
    n = index.shape[0]
    out = torch.empty((batch, n, hidden), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    cfg = config_for("rows", x)
    block_h = cfg["BLOCK_H"]
    grid = (batch * n, -(-hidden // block_h))
    _gather_rows_fwd_kernel[grid](x, index, out, n, hidden, x.stride(0), x.stride(1), out.stride(0),
                                  out.stride(1), BLOCK_H=block_h, num_warps=cfg.num_warps)
    return out


def _owner_maps(indices: list[torch.Tensor], seq_len: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Which part owns each destination row (-1: none) and the row of that part, int32 ``(seq_len,)``.

    Memoized per index set (a layout's indices are reused every step) and built without host
    read-backs: ``index_fill_`` takes the part number as a kernel argument, where ``owner[index] = p``
    would copy it from pageable host memory and stall the queue. Indices are disjoint, so no two
    writes meet.
    """
    def build() -> tuple[torch.Tensor, torch.Tensor]:
        owner = torch.full((seq_len,), -1, dtype=torch.int32, device=device)
        local = torch.zeros((seq_len,), dtype=torch.int32, device=device)
        for p, index in enumerate(indices):
            rows = index.to(torch.int64)
            owner.index_fill_(0, rows, p)
            local[rows] = torch.arange(index.shape[0], dtype=torch.int32, device=device)
        return owner, local

    return memoized_over(indices, ("owner_maps", seq_len), build)


def scatter_rows_fwd(parts: list[torch.Tensor], indices: list[torch.Tensor], seq_len: int) -> torch.Tensor:
    """Trusted launcher: parts (B, Ni, H), valid disjoint indices (Ni,) -> (B, seq_len, H), zeros elsewhere."""
    first = parts[0]
    batch, hidden = first.shape[0], first.shape[2]
    out = torch.empty((batch, seq_len, hidden), dtype=first.dtype, device=first.device)
    if out.numel() == 0:
        return out
    cfg = config_for("rows", first)
    block_h = cfg["BLOCK_H"]
    owner, local = _owner_maps(indices, seq_len, first.device)
    grid = (batch * seq_len, -(-hidden // block_h))
    for p, part in enumerate(parts):
        # Launch 0 also writes the zero rows; later launches only their own rows.
        _scatter_rows_fwd_kernel[grid](part, owner, local, out, seq_len, hidden, p, part.stride(0),
                                       part.stride(1), out.stride(0), out.stride(1), WRITE_ZEROS=p == 0,
                                       BLOCK_H=block_h, num_warps=cfg.num_warps)
    return out


@kernel_op("flowlock::gather_rows_fwd")
def _gather_rows_op(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The gather as one opaque op, so torch.compile and CUDA graphs replay the same launch."""
    return gather_rows_fwd(x, index)


@_gather_rows_op.register_fake
def _(x, index):
    return x.new_empty((x.shape[0], index.shape[0], x.shape[2]))


@kernel_op("flowlock::scatter_rows_fwd")
def _scatter_rows_op(parts: list[torch.Tensor], indices: list[torch.Tensor], seq_len: int) -> torch.Tensor:
    """The scatter (all parts, zero gaps) as one opaque op."""
    return scatter_rows_fwd(parts, indices, seq_len)


@_scatter_rows_op.register_fake
def _(parts, indices, seq_len):
    return parts[0].new_empty((parts[0].shape[0], seq_len, parts[0].shape[2]))


class GatherRowsFunction(torch.autograd.Function):
    """Gather forward; backward scatters the output gradient into zeros (a copy, no accumulation)."""

    @staticmethod
    def forward(ctx, x, index):
        ctx.save_for_backward(index)
        ctx.seq_len = x.shape[1]
        return (_gather_rows_op if traced() else gather_rows_fwd)(x, index)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        return (_scatter_rows_op if traced() else scatter_rows_fwd)([grad.contiguous()], [index], ctx.seq_len), None


class ScatterRowsFunction(torch.autograd.Function):
    """Scatter forward; backward gathers each part's gradient rows (copies)."""

    @staticmethod
    def forward(ctx, seq_len, num_parts, *tensors):
        parts, indices = list(tensors[:num_parts]), list(tensors[num_parts:])
        ctx.save_for_backward(*indices)
        return (_scatter_rows_op if traced() else scatter_rows_fwd)(parts, indices, seq_len)

    @staticmethod
    def backward(ctx, grad):
        indices = ctx.saved_tensors
        grad = grad.contiguous()
        gather = _gather_rows_op if traced() else gather_rows_fwd
        grads = tuple(gather(grad, index) for index in indices)
        return (None, None, *grads, *(None for _ in indices))
