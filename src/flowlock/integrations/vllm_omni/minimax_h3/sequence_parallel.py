"""vLLM-Omni's MiniMax-H3 under Ulysses sequence parallelism on the strict path, with one process's bits.

vLLM-Omni runs H3's DiT blocks on row shards of the packed sequence (its ``_sp_plan`` hooks split at
``sp_prepare`` and gather at ``sp_gather``; the serving layout is padded to a multiple of 64), trades
rows for heads with an all-to-all around attention, and keeps the token refiner replicated
(``skip_sequence_parallel``). The strict forward does the same with flowlock's Ulysses
(:mod:`flowlock.parallel.ulysses`): every rank embeds all rows and runs the refiner on the whole text
as at one process, the blocks run on :class:`~flowlock.parallel.shards.RowShards` of the packed rows
(any length, so the 64-row padding is not needed for the bits), attention sees every row of its heads
and attends per ``cu_seqlens`` document as at one process, and the rows are gathered before the final
layer. Every GEMM keeps its whole K and is row-invariant, so each rank's rows are the single-process
bits. vLLM-Omni's SP hooks stay installed and unused (the strict forward never calls the hooked
modules). Ulysses = 1 never builds a :class:`NativeUlysses`.
"""

from __future__ import annotations

import torch
from torch import nn

from flowlock.parallel.ulysses import Ulysses, UlyssesSequence, check_heads

# The attribute install() sets on every patched module (through the patch plan, so remove() drops it).
ATTRIBUTE = "_flowlock_ulysses"
# The identity modules vLLM-Omni's H3 ``_sp_plan`` hooks; the strict forward never calls them.
SP_PLAN_MODULES = frozenset({"sp_prepare", "local_sp_prepare", "sp_gather"})


class NativeUlysses:
    """The strict forward's Ulysses group for one installed ``MiniMaxH3DiTModel``."""

    def __init__(self, ulysses: Ulysses):
        self.ulysses = ulysses

    @property
    def degree(self) -> int:
        return self.ulysses.degree

    @classmethod
    def for_model(cls, model: nn.Module) -> NativeUlysses | None:
        """None at ``ulysses_degree`` 1 (nothing built, no collective); else vLLM-Omni's Ulysses group.

        Also None when vLLM-Omni's diffusion groups are not initialized (a ``ulysses_degree`` this
        process cannot run): coverage then refuses the model at its forward, naming the degree.
        Raises ValueError naming the reason for a layout the strict path does not serve: ring or
        hybrid sequence parallelism, Ulysses together with TP > 1, a degree that does not divide the
        heads, or a vLLM-Omni SP group of another size.
        """
        config = model.parallel_config
        degree = int(getattr(config, "ulysses_degree", 1) or 1)
        if degree == 1:
            return None
        ring = int(getattr(config, "ring_degree", 1) or 1)
        if ring != 1:
            raise ValueError(f"ring sequence parallelism (ring_degree {ring}) is not on the strict path: ring "
                             "attention merges partial softmaxes and is not one process's bits")
        from vllm.distributed.parallel_state import get_tp_group
        from vllm_omni.diffusion.distributed.parallel_state import get_sp_group, model_parallel_is_initialized

        if not model_parallel_is_initialized():
            return None
        if get_tp_group().world_size != 1:
            raise ValueError(f"Ulysses degree {degree} with tensor parallel size {get_tp_group().world_size} is "
                             "not on the strict path (each is served alone)")
        check_heads(model.arch.num_attention_heads, degree, "MiniMax-H3's attention")
        group = get_sp_group()
        if group.ulysses_world_size != degree or group.ring_world_size != 1:
            raise ValueError(f"vLLM-Omni's sequence-parallel group has Ulysses size {group.ulysses_world_size} and "
                             f"ring size {group.ring_world_size}, the model's parallel_config ulysses_degree "
                             f"{degree}")
        return cls(Ulysses(group.ulysses_group))

    def sequence(self, model: nn.Module, seq_len: int, num_requests: int, device: torch.device) -> UlyssesSequence:
        """This forward's row shards of ``seq_len`` packed rows; the ranks agree on the length, the
        request count and the model's depth and width first (one small all-gather) or raise ValueError."""
        contract = (num_requests, len(model.blocks), model.arch.hidden_size)
        return self.ulysses.for_sequence(seq_len, contract, device=device)
