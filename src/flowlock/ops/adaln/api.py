"""Public ``adaln_table`` and ``adaln_modulation``: validation, then explicit dispatch."""

from __future__ import annotations

import torch

from flowlock.dispatch import backend_for
from flowlock.ops._graph import needs_graph
from flowlock.ops._triton_utils import traced
from flowlock.ops._validate import FLOAT_DTYPES, check_index, check_tensor
from flowlock.ops.adaln.opaque import adaln_modulation_reference_op, adaln_table_reference_op
from flowlock.ops.adaln.reference import adaln_modulation_reference, adaln_table_reference
from flowlock.ops.adaln.triton import (
    AdalnModulationFunction,
    AdalnTableFunction,
    AdalnTableKeptFunction,
    modulation_forward,
    projection,
)


def check_projection(temb: object, weight: object, bias: object, outputs_per_h: int) -> tuple[int, int, int]:
    """Validate temb (T, E) fp32, weight (k*H, E) bf16 / fp16 / fp32, bias (k*H,) of the weight's dtype on
    one device; return (T, E, H).

    ``outputs_per_h`` is ``k``: 18 for the AdaLN table, 2 for the final norm's shift/scale.
    """
    temb = check_tensor("temb", temb, dtypes=(torch.float32,), ndim=2)
    device = temb.device
    t, e = temb.shape
    if t < 1 or e < 1:
        raise ValueError(f"temb must have at least one row and one column, got shape {tuple(temb.shape)}")
    weight = check_tensor("weight", weight, dtypes=FLOAT_DTYPES, shape=(None, e), device=device)
    n = weight.shape[0]
    if n == 0 or n % outputs_per_h:
        raise ValueError(f"weight must have {outputs_per_h}*H rows (H >= 1), got {n}")
    check_tensor("bias", bias, dtypes=(weight.dtype,), shape=(n,), device=device)
    _check_contiguous("temb", temb)
    _check_contiguous("weight", weight)
    _check_contiguous("bias", bias)
    return t, e, n // outputs_per_h


def _check_contiguous(name: str, x: torch.Tensor) -> None:
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def adaln_table(temb: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The AdaLN modulation table of one block.

    Args:
        temb: ``(T, E)`` float32 timestep embeddings (one row per distinct timestep).
        weight: ``(18H, E)`` bfloat16, float16 or float32 ``adaln_proj.linear.weight``.
        bias: ``(18H,)`` ``adaln_proj.linear.bias``, of the weight's dtype.

    Returns:
        ``(3T, 6H)`` float32 holding the projection output in the weight's dtype ``w`` exactly:
        ``w(w(silu(temb)) @ weight^T + bias)`` viewed as ``(T, 18H) -> (3T, 6H)``; row
        ``ti*3 + tag``, columns ``c*H:(c+1)*H`` for chunk ``c`` of (shift_msa, scale_msa, gate_msa,
        shift_mlp, scale_mlp, gate_mlp).

    Guarantees: SiLU in FP32 before the one cast to the weight's dtype (none for float32); FP32
    accumulation over E in a fixed order (true FP32 products for float32 weights, no TF32), so each
    row is a pure function of its temb row (independent of T); differentiable as one node whose
    FP32 table gradient is never rounded before ``dW`` (the weight's dtype, T rows summed in
    ascending order), ``db`` (likewise) and ``d_temb`` (FP32, N reduced in fixed chunks folded
    ascending).
    """
    t, _, _ = check_projection(temb, weight, bias, 18)
    if backend_for("adaln_table", temb) == "reference":
        return (adaln_table_reference_op if traced() else adaln_table_reference)(temb, weight, bias)
    if needs_graph(temb, weight, bias):
        return AdalnTableFunction.apply(temb, weight, bias).view(3 * t, -1)
    # No gradient can flow: the node's own forward launches, without recording it.
    return projection(temb, weight, bias)[1].view(3 * t, -1)


def adaln_table_kept(table: torch.Tensor, temb: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """:func:`adaln_table` of ``temb``, ``weight``, ``bias`` when its values are at hand: ``table``, a
    detached result of that call on the same inputs (a gradient-checkpointing recomputation has the
    forward's). Returns a view of ``table`` as the same autograd node, without streaming the weight
    again (``18H x E``: 520 MB a block at H3's widths).

    Args:
        table: ``(3T, 6H)`` float32, contiguous.
        temb, weight, bias: as :func:`adaln_table`.

    Guarantees: the gradients are :func:`adaln_table`'s, bit for bit (same saved tensors, same
    backward launches). ``table`` itself is trusted to be that call's result: only its shape, dtype,
    device and contiguity are checked. The reference backend and traced (compiled) calls compute the table
    again instead: the float64 spec has nothing to save, and compiled graphs keep the node they
    traced.
    """
    t, _, h = check_projection(temb, weight, bias, 18)
    check_tensor("table", table, dtypes=(torch.float32,), shape=(3 * t, 6 * h), device=temb.device)
    _check_contiguous("table", table)
    if traced():
        return adaln_table(temb, weight, bias)
    if backend_for("adaln_table_kept", temb) == "reference":
        return adaln_table_reference(temb, weight, bias)
    if needs_graph(temb, weight, bias):
        return AdalnTableKeptFunction.apply(temb, weight, bias, table.view(t, -1)).view(3 * t, -1)
    return table


def adaln_modulation(temb: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                     timestep_indices: torch.Tensor, token_tags: torch.Tensor, *,
                     check_indices: bool = True) -> tuple[torch.Tensor, ...]:
    """Per-row AdaLN modulation of one block: projection and row gather as one autograd node.

    Args:
        temb, weight, bias: as :func:`adaln_table` (temb ``(T, E)`` fp32; weight ``(18H, E)`` and
            bias ``(18H,)`` bf16, fp16 or fp32).
        timestep_indices: ``(S,)`` int32/int64 in ``[0, T)``.
        token_tags: ``(S,)`` int32/int64 modality tags in ``{0, 1, 2}`` (video, text, audio).
        check_indices: range-check the indices (a host readback); pass ``False`` only for indices
            already validated.

    Returns:
        Six ``(S, H)`` tensors of the weight's dtype ``(shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp,
        gate_mlp)``, row ``s`` taken from table row ``timestep_indices[s]*3 + token_tags[s]``.

    Guarantees: forward bitwise equal to diffusers' ``adaln_proj(temb)`` chunks gathered with
    ``index_select(0, adaln_indices)`` given the same table; rows pure. Backward: the six
    gradients are summed per table row by a deterministic segmented sum in FP32 and passed, FP32,
    straight into the projection backward (no BF16 table gradient, no scatter-add).
    """
    t, _, _ = check_projection(temb, weight, bias, 18)
    device = temb.device
    check_index("timestep_indices", timestep_indices, length=None, upper=t, device=device,
                check_range=check_indices)
    check_index("token_tags", token_tags, length=timestep_indices.shape[0], upper=3, device=device,
                check_range=check_indices)
    _check_contiguous("timestep_indices", timestep_indices)
    _check_contiguous("token_tags", token_tags)
    # The checks above put every tensor on temb's device: the backend follows from temb alone.
    if backend_for("adaln_modulation", temb) == "reference":
        spec = adaln_modulation_reference_op if traced() else adaln_modulation_reference
        return spec(temb, weight, bias, timestep_indices, token_tags)
    if needs_graph(temb, weight, bias):
        return AdalnModulationFunction.apply(temb, weight, bias, timestep_indices, token_tags)
    # No gradient can flow: the node's own forward launches, without recording it.
    return modulation_forward(temb, weight, bias, timestep_indices, token_tags)[1]
