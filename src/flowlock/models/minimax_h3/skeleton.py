"""The body of H3's blocks, written once for both engines' strict paths.

The diffusers trainer (:mod:`flowlock.models.minimax_h3.strict`) and the vLLM-Omni rollout
(:mod:`flowlock.integrations.vllm_omni.minimax_h3.forward`) hold the same block in different
modules and feed it different inputs, but must compute it with the same ops, on the same values,
in the same order, so that both give the same bits. Here is that order, once; each engine supplies
its steps (how it builds the AdaLN table, modulates, attends, runs the feed-forward and gates the
residual: its parameters, its hooks and fallbacks, its tensor or sequence parallelism) as a small
object, and keeps its own input handling.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

# Rows of the AdaLN table per distinct timestep: modality tags 0 video, 1 text, 2 audio (row =
# timestep index * MODALITIES + tag).
MODALITIES = 3
# Column chunks of the (MODALITIES * T, 6 * hidden) AdaLN table, in diffusers' chunk order.
SHIFT_MSA, SCALE_MSA, GATE_MSA, SHIFT_MLP, SCALE_MLP, GATE_MLP = range(6)
CHUNKS = 6


class BlockSteps(Protocol):
    """One engine's steps of one DiT block call (bound to the block and its call's inputs)."""

    def table(self) -> torch.Tensor:
        """The block's AdaLN table: ``(MODALITIES * T, CHUNKS * hidden)`` FP32."""

    def modulate(self, norm: nn.Module, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor,
                 index: torch.Tensor) -> torch.Tensor:
        """``norm(x) * (1 + scale[index]) + shift[index]``, in the rows' dtype."""

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        """The block's attention on its modulated rows (same shape)."""

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block's SwiGLU feed-forward on its modulated rows (same shape)."""

    def gate(self, x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """``x + gate[index] * y``: the gated residual."""


class RefinerSteps(Protocol):
    """One engine's steps of one token-refiner block call."""

    def norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``norm(x)``: RMSNorm of the text rows."""

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        """The block's attention (no RoPE) on the normalised text rows."""

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block's SwiGLU feed-forward on the normalised text rows."""


def block_body(steps: BlockSteps, block: nn.Module, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """An H3 DiT block: table -> six chunks -> modulate -> attention -> gated residual -> modulate ->
    feed-forward -> gated residual. ``x``: the block's rows, hidden last, in the model's compute dtype
    (bf16 for H3); ``index``: each row's AdaLN table row. ``block.norm1`` / ``block.norm2`` are the two
    norms (both engines name them so)."""
    table = steps.table()
    hidden = x.shape[-1]
    chunk = [table[:, c * hidden:(c + 1) * hidden] for c in range(CHUNKS)]
    normed = steps.modulate(block.norm1, x, chunk[SHIFT_MSA], chunk[SCALE_MSA], index)
    x = steps.gate(x, chunk[GATE_MSA], steps.attend(normed), index)
    normed = steps.modulate(block.norm2, x, chunk[SHIFT_MLP], chunk[SCALE_MLP], index)
    return steps.gate(x, chunk[GATE_MLP], steps.feed_forward(normed), index)


def refiner_body(steps: RefinerSteps, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """An H3 token-refiner block: two pre-norm residuals, attention then feed-forward, on text rows."""
    # A plain add in the rows' dtype: what both engines' eager code does, elementwise.
    x = x + steps.attend(steps.norm(block.norm1, x))
    return x + steps.feed_forward(steps.norm(block.norm2, x))
