"""The tensor transforms between diffusers and native H3 layouts. All are row permutations or
copies (no arithmetic), so every round trip is bitwise; every result is a fresh contiguous tensor.

q/k/v layouts of the fused native ``qkv_proj.weight`` [3 * heads * head_dim, in]:

* ``stacked``: [Q_all; K_all; V_all], what ``MiniMaxH3DiTModel`` holds in memory (load it with
  ``load_state_dict``), Comfy single files and GGUFs;
* ``interleaved``: per head [q_h; k_h; v_h] (head_dim rows each), what the official native shards
  hold and what vLLM-Omni's ``load_weights`` de-interleaves for native names.

The two have the same shape, so the layout is always an argument and never inferred.
"""

from __future__ import annotations

import torch

from flowlock.checkpoint.errors import CheckpointError

QKV_LAYOUTS = ("stacked", "interleaved")


def check_qkv_layout(layout: object) -> str:
    if layout not in QKV_LAYOUTS:
        raise CheckpointError(f"qkv layout must be one of {', '.join(QKV_LAYOUTS)}; got {layout!r}")
    return layout


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str, head_dim: int) -> torch.Tensor:
    """[heads*head_dim, in] x 3 -> [3*heads*head_dim, in] in ``layout`` (shapes and dtypes checked by the caller)."""
    if check_qkv_layout(layout) == "stacked":
        return torch.cat((q, k, v), dim=0)
    heads = q.shape[0] // head_dim
    per_head = [t.reshape(heads, head_dim, *t.shape[1:]) for t in (q, k, v)]
    return torch.cat(per_head, dim=1).reshape(3 * heads * head_dim, *q.shape[1:])


def split_qkv(qkv: torch.Tensor, layout: str, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv`: three [heads*head_dim, in] tensors, each with its own storage."""
    rows = qkv.shape[0] // 3
    if check_qkv_layout(layout) == "stacked":
        parts = qkv.split(rows, dim=0)
    else:
        grouped = qkv.reshape(rows // head_dim, 3, head_dim, *qkv.shape[1:])
        parts = tuple(grouped[:, slot].reshape(rows, *qkv.shape[1:]) for slot in range(3))
    return tuple(p.clone(memory_format=torch.contiguous_format) for p in parts)


def swap_halves(weight: torch.Tensor) -> torch.Tensor:
    """[a; b] -> [b; a] along rows: diffusers fc1 [value; gate] <-> native [gate; value] (an involution)."""
    first, second = weight.chunk(2, dim=0)
    return torch.cat((second, first), dim=0)


def rope_inv_freq(rope_freq_dim: int, rope_theta: float) -> torch.Tensor:
    """[rope_freq_dim] float32, computed on the CPU by the expression diffusers' ``MiniMaxH3RotaryPosEmbed``
    and vLLM-Omni's ``load_weights`` both use, so it matches either bit for bit."""
    exponent = torch.arange(0, 2 * rope_freq_dim, 2, dtype=torch.float32, device="cpu") / (2 * rope_freq_dim)
    return 1.0 / (rope_theta ** exponent)
