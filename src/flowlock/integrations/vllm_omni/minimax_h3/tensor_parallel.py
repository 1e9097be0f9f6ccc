"""vLLM-Omni's MiniMax-H3 at tensor-parallel degree ``N > 1`` on the strict path, with TP = 1's bits.

vLLM-Omni shards H3 with vLLM's parallel linears and keeps every activation replicated. The strict
forward uses each rank's weight blocks as vLLM loaded them (nothing is resharded or held besides
them) and replaces every reduction that TP would split (:mod:`flowlock.parallel.tensor_parallel`):

* column-sharded, whole K on each rank, then gathered columns (TP = 1 bits, as the GEMM rule makes
  each output element a function of its X row and W row only): the patch and condition projections,
  the two output heads, q / k / v of the local heads, fc1's local [gate; up] halves (then ``swiglu``,
  elementwise) and every block's AdaLN table;
* K-sharded (vLLM's row-parallel, whose stock forward all-reduces partial sums): ``out_proj`` and
  ``fc2`` of every DiT and refiner block run :meth:`TensorParallel.k_sharded_linear` (all-to-all to
  whole-K rows, the GEMM over the whole K from the gathered weight, all-gather of rows);
* vLLM-Omni's LoRA layers: column-sharded ones hold the whole ``lora_A`` and this rank's rows of
  ``lora_B``, so their local columns are TP = 1's; on ``out_proj`` / ``fc2`` ``lora_A`` is K-sharded
  and is gathered per forward (``r x K``, small), the adapter added on the whole-K rows;
* the fused ops that need whole weights (``timestep_mlp`` and ``final_adaln_out``) get them gathered
  per forward (63 MB and 58 MB at H3 widths, once per forward, not per block).

Attention runs on the local heads over all rows, as at TP = 1 (every (sample, head, row) is pure).
TP = 1 never builds a :class:`NativeTensorParallel` and never issues a collective.
"""

from __future__ import annotations

import torch
from torch import nn

from flowlock.integrations.vllm_omni.layers import LINEAR_CLASSES
from flowlock.integrations.vllm_omni.lora import add_lora, is_lora_layer
from flowlock.ops._validate import memoized_over
from flowlock.ops.adaln import adaln_table
from flowlock.ops.linear import linear
from flowlock.parallel.tensor_parallel import TensorParallel, check_divisible

# The attribute install() sets (through the patch plan, so remove() drops it) on every patched module.
ATTRIBUTE = "_flowlock_tensor_parallel"


def _linears(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, LINEAR_CLASSES)]


def layout_widths(model: nn.Module) -> dict[str, int]:
    """Every dimension vLLM-Omni shards across the TP ranks, by what it is (the full, unsharded sizes)."""
    arch = model.arch
    final = model.final_layer
    return {
        "attention heads": arch.num_attention_heads,
        "FFN width": arch.ffn_hidden_size,
        "hidden size": arch.hidden_size,
        "time embedder hidden width": model.time_embedder.proj_in.output_size,
        "video output width": final.video_out.output_size,
        "audio output width": final.audio_out.output_size,
    }


class NativeTensorParallel:
    """The strict forward's TP operations for one installed ``MiniMaxH3DiTModel`` on ``tp``'s group."""

    def __init__(self, tp: TensorParallel):
        self.tp = tp

    @property
    def degree(self) -> int:
        return self.tp.degree

    @classmethod
    def for_model(cls, model: nn.Module) -> NativeTensorParallel | None:
        """None at TP = 1 (no collective, nothing built); else the layout, checked on every rank.

        Raises ValueError (naming the reason) when the degree does not divide the heads, the FFN or
        another sharded width, when a linear is not sharded over vLLM's TP group, or when the ranks
        disagree on the layout (one small all-gather over the group, at install only).
        """
        from vllm.distributed.parallel_state import get_tp_group

        group = get_tp_group()
        if group.world_size == 1:
            return None
        check_divisible(group.world_size, layout_widths(model))
        for name, module in _linears(model):
            if (module.tp_size, module.tp_rank) != (group.world_size, group.rank_in_group):
                raise ValueError(f"{name} is sharded as rank {module.tp_rank} of {module.tp_size}, not as rank "
                                 f"{group.rank_in_group} of vLLM's tensor-parallel group of {group.world_size}")
        tp = TensorParallel(group.device_group)
        arch = model.arch
        contract = [len(model.blocks), len(model.token_refiner.blocks), arch.hidden_size, arch.num_attention_heads,
                    arch.attention_head_dim, arch.ffn_hidden_size, len(_linears(model))]
        tp.agree("the vLLM-Omni H3 layout", contract, device=model.video_patch_proj.weight.device)
        return cls(tp)

    def gathered_linear(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """A column-sharded ``gather_output`` linear: ``(..., K)`` -> ``(..., n)`` on every rank."""
        return self.tp.gather_columns(linear(x, module.weight, module.bias))

    def k_sharded_linear(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """vLLM's row-parallel ``out_proj`` / ``fc2`` (no bias): ``(S, K / N)`` local block -> ``(S, n)``.

        Wrapped by vLLM-Omni's LoRA layer, whose ``lora_A`` holds this rank's K block (``lora_B`` is
        whole): ``lora_A``'s blocks are gathered and the adapter runs on the whole-K rows of this rank's
        row shard, added to the base rows before they are gathered, as :func:`add_lora` at TP = 1."""
        if not is_lora_layer(module):
            return self.tp.k_sharded_linear(x, module.weight)
        # Held while the adapter's buffers are unchanged, so its factors (and their rank, read on the host)
        # are too. Every rank reuses or regathers together: vLLM writes the buffers on all ranks at once.
        whole_a = [memoized_over([a, b], "tp_whole_lora_a", lambda a=a: self.tp.gather_blocks(a, dim=3))
                   for a, b in zip(module.lora_a_stacked, module.lora_b_stacked)]
        return self.tp.k_sharded_linear(x, module.base_layer.weight,
                                        rows_epilogue=lambda rows, out: add_lora(module, rows, [out], whole_a)[0])

    def adaln_table(self, t_emb: torch.Tensor, proj: nn.Module) -> torch.Tensor:
        """A block's ``(3M, 6H)`` FP32 AdaLN table from this rank's ``(18H / N, E)`` rows of the projection."""
        m = t_emb.shape[0]
        local = adaln_table(t_emb, proj.weight, proj.bias).view(m, -1)
        return self.tp.gather_columns(local).view(3 * m, -1)

    def time_embedder_weights(self, embedder: nn.Module) -> tuple[torch.Tensor, ...]:
        """``(w1, b1, w2, b2)`` whole: proj_in's output rows and proj_out's K blocks gathered (its bias is whole)."""
        p, q = embedder.proj_in, embedder.proj_out
        return (self.tp.gather_blocks(p.weight, 0), self.tp.gather_blocks(p.bias, 0),
                self.tp.gather_blocks(q.weight, 1), q.bias)

    def final_adaln_weights(self, final: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """The final layer's whole ``(2H, E)`` shift / scale projection and its bias."""
        ada = final.adaln_proj.linear
        return self.tp.gather_blocks(ada.weight, 0), self.tp.gather_blocks(ada.bias, 0)
