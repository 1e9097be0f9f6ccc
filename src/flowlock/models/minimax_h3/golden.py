"""FP64 golden of a whole ``MiniMaxH3Transformer3DModel``: diffusers' own forward in float64, rounded
(straight-through) where the model stores a value in its own dtype.

It is independent of the strict composition: it runs diffusers' code, so a mistake in flowlock's
wiring cannot hide in the golden. Storage points rounded: every parameterised leaf module's output
to that module's dtype (BF16 linears and norms, FP32 input / output heads and timestep MLP), the
inputs of BF16 linears (``silu(temb)`` is cast to BF16 before the AdaLN projections), and the
residual stream entering and leaving each block (the packed buffer and block outputs are BF16).
Elementwise intermediates inside a module stay exact, so the golden is at least as accurate as any
BF16 implementation; gradients are those of the exact arithmetic (straight-through rounding).
"""

from __future__ import annotations

import copy

import torch
from diffusers.models.transformers.transformer_minimax_h3 import (
    MiniMaxH3AdaLayerNormOut,
    MiniMaxH3TokenRefinerBlock,
    MiniMaxH3TransformerBlock,
)
from torch import nn

from flowlock.ops._rounding import st_round


def _round_output(dtype: torch.dtype):
    def hook(module, args, output):
        return st_round(output, dtype)
    return hook


def _round_first_input(dtype: torch.dtype):
    def hook(module, args):
        return (st_round(args[0], dtype), *args[1:])
    return hook


def golden_model(model: nn.Module) -> nn.Module:
    """A float64 copy of ``model`` whose forward is the golden (instance-level forwards, such as
    flowlock's patches, are dropped from every module of the copy).

    Feed it the same inputs as ``model`` (they are cast by diffusers' own code); its parameters are
    float64 copies holding the original values exactly, so its parameter gradients are the golden
    gradients, matched to ``model``'s by name.
    """
    golden = copy.deepcopy(model)
    for module in golden.modules():
        module.__dict__.pop("forward", None)
    dtypes = {}
    for name, module in golden.named_modules():
        params = list(module.parameters(recurse=False))
        if params:
            dtypes[name] = params[0].dtype
    block_dtype = golden.transformer_blocks[0].norm1.weight.dtype if len(golden.transformer_blocks) else None
    golden.double()
    for name, module in golden.named_modules():
        if name in dtypes:
            module.register_forward_hook(_round_output(dtypes[name]))
            if isinstance(module, nn.Linear) and dtypes[name] != torch.float32:
                module.register_forward_pre_hook(_round_first_input(dtypes[name]))
        if isinstance(module, (MiniMaxH3TransformerBlock, MiniMaxH3TokenRefinerBlock)) and block_dtype:
            module.register_forward_pre_hook(_round_first_input(block_dtype))
            module.register_forward_hook(_round_output(block_dtype))
        if isinstance(module, MiniMaxH3AdaLayerNormOut) and block_dtype:
            module.register_forward_hook(_round_output(block_dtype))
    return golden.eval()


def golden_inputs(inputs: dict) -> dict:
    """The forward's keyword arguments with floating latents as float64 (timestep kept as given)."""
    out = {}
    for key, value in inputs.items():
        if torch.is_tensor(value) and value.is_floating_point() and key != "timestep":
            value = value.double()
        out[key] = value
    return out
