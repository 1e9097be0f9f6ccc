"""PyTorch spec and FP64 goldens of ``adaln_table`` and ``adaln_modulation``.

Rounding points (where the model stores a value in the projection weight's dtype ``w``: bf16,
fp16 or fp32): the activation ``w(silu(temb))`` (SiLU in FP32 or wider, never after a cast) and the
projection output ``w(act @ W^T + b)``. Both are straight-through in the backward, so the table
gradient stays at the compute precision (FP32 in the spec, FP64 in the golden) until it reaches
``dW``/``db``, which are rounded once to the parameters' dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flowlock.ops._position_free import in_float64
from flowlock.ops._rounding import st_round
from flowlock.ops.segment_sum.reference import table_lookup_reference


def _projection(temb: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                compute: torch.dtype, store: torch.dtype) -> torch.Tensor:
    # SiLU in float64, rounded to the compute dtype: a CPU fp32 SiLU's bits depend on a row's place
    # in the (T, E) tensor, i.e. on the other timesteps beside it (flowlock.ops._position_free).
    act = st_round(in_float64(F.silu, temb.to(compute)), store)
    # Accumulate in float64 whatever the compute dtype: a CPU FP32 GEMM picks its summation order
    # from the row count T (seen at H3 widths: a row's table differed alone vs beside two other
    # timesteps), while float64 sums rounded once do not depend on the other rows.
    out = F.linear(act.double(), weight.double(), bias.double()).to(compute)
    return st_round(out, store)


def adaln_projection_reference(temb: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``(T, N)`` FP32 holding ``w(w(silu(temb)) @ weight^T + bias)``, ``w`` the weight's dtype; differentiable."""
    return _projection(temb, weight, bias, torch.float32, weight.dtype)


def adaln_projection_golden(temb: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                            dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """FP64 golden of :func:`adaln_projection_reference` for a model storing ``dtype`` (the weight's
    dtype there; pass float64 leaves to get exact gradients): same rounding points, straight-through."""
    return _projection(temb, weight, bias, torch.float64, dtype)


def adaln_table_reference(temb: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``(3T, 6H)`` FP32 table from temb (T, E) fp32, weight (18H, E) and bias (18H,) bf16 / fp16 / fp32."""
    return adaln_projection_reference(temb, weight, bias).view(3 * temb.shape[0], -1)


def adaln_table_golden(temb: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                       dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """FP64 golden of :func:`adaln_table_reference` (``dtype`` as :func:`adaln_projection_golden`)."""
    return adaln_projection_golden(temb, weight, bias, dtype).view(3 * temb.shape[0], -1)


def adaln_modulation_reference(temb: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                               timestep_indices: torch.Tensor, token_tags: torch.Tensor
                               ) -> tuple[torch.Tensor, ...]:
    """Six ``(S, H)`` tensors of the weight's dtype: rows ``ti*3+tag`` of the table's six column chunks."""
    table = adaln_table_reference(temb, weight, bias)
    rows = timestep_indices.long() * 3 + token_tags.long()
    # The gather's backward is a deterministic segmented sum (never index_select's scatter-add).
    return tuple(c.to(weight.dtype) for c in table_lookup_reference(table, rows).chunk(6, dim=-1))


def adaln_modulation_golden(temb: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                            timestep_indices: torch.Tensor, token_tags: torch.Tensor,
                            dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, ...]:
    """FP64 golden: six ``(S, H)`` FP64 tensors holding the model's values (stored in ``dtype``)."""
    table = adaln_table_golden(temb, weight, bias, dtype)
    rows = timestep_indices.long() * 3 + token_tags.long()
    return tuple(table[rows].chunk(6, dim=-1))
