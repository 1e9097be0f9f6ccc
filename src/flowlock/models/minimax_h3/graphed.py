"""CUDA graphs of the H3 forward or training step for one packed layout.

:func:`capture_h3` is :func:`flowlock.cuda_graphs.capture` with H3's rules: the layout's index
tensors (``LAYOUT_INPUTS``) are fixed by the capture, and every replay's latents and timesteps are
checked as the strict forward checks them (shapes, dtypes, timesteps finite in [0, 1]) before
anything is copied. An RL trainer recomputing log-probs and gradients for many samples of one
layout (one resolution and duration) captures once per layout and replays per micro-batch.

One device, unsharded: FSDP2 units re-allocate their unsharded parameters in every forward (a graph
would write into memory the allocator has handed on), and diffusers context parallelism is not
checked under capture, so both are refused.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from flowlock.cuda_graphs import CapturedCall, capture
from flowlock.finite import check_finite_samples
from flowlock.models.minimax_h3.context_parallel import context_parallel_config
from flowlock.models.minimax_h3.structure import validate_structure

LAYOUT_INPUTS = ("timestep_indices", "token_tags", "position_ids", "video_indices", "audio_indices", "text_indices")
MODEL_INPUTS = ("hidden_states", "audio_hidden_states", "encoder_hidden_states", "timestep", *LAYOUT_INPUTS)


def validate_inputs(inputs: Mapping[str, torch.Tensor]) -> None:
    """The strict forward's structural checks on the model arguments among ``inputs``, and its
    non-finite check of the latents (one host sync, before anything is copied; switchable as there)."""
    missing = [n for n in MODEL_INPUTS if n not in inputs]
    if missing:
        raise ValueError(f"a captured H3 call takes the model's inputs by name; missing: {', '.join(missing)}")
    validate_structure(**{n: inputs[n] for n in MODEL_INPUTS})
    check_finite_samples([(n, inputs[n]) for n in MODEL_INPUTS[:3]])  # the latents; a replay runs no Python forward


def capture_h3(model: nn.Module, fn: Callable[..., Any], inputs: Mapping[str, torch.Tensor],
               warmup: int = 2) -> CapturedCall:
    """Capture ``fn(**inputs)``, a call of ``model`` (forward, or forward and backward) whose inputs
    include the model's by their argument names (others, such as cotangents or advantages, may
    follow). Returns the :class:`~flowlock.cuda_graphs.CapturedCall`; replay it with new latents,
    timesteps or other non-layout inputs."""
    from torch.distributed.fsdp import FSDPModule

    if any(isinstance(m, FSDPModule) for m in model.modules()):
        raise ValueError("capture_h3 serves an unsharded model: FSDP2 units re-allocate their unsharded parameters "
                         "in every forward, which a replayed graph would not follow")
    if context_parallel_config(model) is not None:
        raise ValueError("capture_h3 serves a model on one device: diffusers context parallelism is not supported "
                         "under capture")
    return capture(fn, inputs, modules=[model], fixed=LAYOUT_INPUTS, validate=validate_inputs, warmup=warmup)
