"""PyTorch spec and FP64 golden of full non-causal attention in diffusers' BSHD layout.

Rounding points of the spec (the Triton kernel has the same ones):

* scores ``q @ k^T`` are formed from the inputs in fp32 (the spec rounds float64 sums of the exact
  products once to fp32, so its CPU bits do not depend on the row count);
* they are multiplied by the fp32 constant ``scale * log2(e)`` and exponentiated with ``exp2``
  against the row maximum, so softmax runs in fp32 in base 2 (the spec evaluates ``exp2`` in fp64
  and rounds it to fp32: a CPU fp32 ``exp2`` gives other bits in a tensor's tail than in its body,
  see :mod:`flowlock.ops._position_free`);
* the unnormalised probabilities are rounded to the input dtype before ``P @ V`` (as flash
  kernels feed the tensor cores), the ``P @ V`` product is held in fp32 (float64 sums rounded
  once, as the scores), and the division by
  the fp32 row sum of the *unrounded* probabilities happens afterwards;
* the output is rounded once to the input dtype.

The kernel computes the row maximum online (block by block), so its bf16 rounding of ``P`` is
taken against a running maximum; the spec uses the final maximum. Both are the same computation
up to that rounding, which is why the kernel is judged against the golden, not bitwise against
the spec.
"""

from __future__ import annotations

import math

import torch
from torch.utils.checkpoint import checkpoint

from flowlock.ops._position_free import in_float64
from flowlock.ops._rounding import st_round

LOG2E = 1.4426950408889634

# Scores of one chunk of query rows are (rows, S) fp32; keeping rows * S under this bound keeps
# the CPU reference's memory O(S) per chunk however long the sequence is.
_CHUNK_ELEMENTS = 1 << 24


def default_scale(head_dim: int) -> float:
    """``1 / sqrt(head_dim)``, the softmax scale when none is given."""
    return 1.0 / math.sqrt(head_dim)


def _product_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` rounded once to fp32 from float64 sums of the exact products. A CPU fp32 GEMM sums in
    an order that depends on its row count (one query row alone takes another kernel than 37 rows
    together) and, under MKL's AVX-512 sgemm, on where its operands start in memory; the float64 sum
    of exact fp32 products differs between those orders far below half a float32 unit."""
    return (a.double() @ b.double()).float()


def _rows_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qk_scale: torch.Tensor) -> torch.Tensor:
    """One (sample, head) chunk: ``q`` (R, D), ``k``/``v`` (S, D) in the input dtype -> (R, D) fp32."""
    scores = _product_f32(q, k.T) * qk_scale
    row_max = scores.amax(dim=-1, keepdim=True)
    p = in_float64(torch.exp2, scores - row_max)
    row_sum = p.sum(dim=-1, keepdim=True)
    return _product_f32(p.to(v.dtype), v) / row_sum


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Spec of :func:`flowlock.ops.attention.attention`: ``(B, S, heads, D)`` in, same shape and dtype out.

    Computed per (sample, head) in chunks of query rows, each chunk checkpointed when gradients
    are needed, so forward and backward memory stay O(S) per chunk. Differentiable.
    """
    batch, seq, heads, dim = q.shape
    qk_scale = torch.tensor(scale * LOG2E, dtype=torch.float32, device=q.device)
    rows = max(1, _CHUNK_ELEMENTS // seq)
    need_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    per_sample = []
    for b in range(batch):
        per_head = []
        for h in range(heads):
            kb, vb = k[b, :, h], v[b, :, h]
            chunks = []
            for r0 in range(0, seq, rows):
                qc = q[b, r0:r0 + rows, h]
                if need_grad:
                    chunks.append(checkpoint(_rows_attention, qc, kb, vb, qk_scale, use_reentrant=False))
                else:
                    chunks.append(_rows_attention(qc, kb, vb, qk_scale))
            per_head.append(torch.cat(chunks, dim=0))
        per_sample.append(torch.stack(per_head, dim=1))
    return torch.stack(per_sample, dim=0).to(q.dtype)


def attention_golden(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """FP64 golden: exact softmax attention of the inputs, rounded once to ``out_dtype``.

    Inputs are taken as exact values (any dtype; pass float64 leaves to get exact gradients), the
    result is float64 holding values of ``out_dtype`` (default ``q.dtype``), rounded
    straight-through so gradients are those of exact attention. Materialises (B, heads, S, S):
    for test shapes only.
    """
    q64, k64, v64 = (t.double().transpose(1, 2) for t in (q, k, v))
    probs = torch.softmax((q64 @ k64.transpose(-1, -2)) * scale, dim=-1)
    out = (probs @ v64).transpose(1, 2)
    return st_round(out, out_dtype or q.dtype)
