"""The strict forward of diffusers' ``MiniMaxH3Transformer3DModel``, built only from flowlock ops.

It follows ``transformer_minimax_h3.py`` step for step, with every arithmetic step replaced by a
flowlock op whose output bits are a pure function of the sample:

* inputs: ``proj_in`` / ``audio_proj_in`` as true-FP32 ``linear`` (inputs cast to FP32 as
  diffusers does), ``context_embedder`` as BF16 ``linear``, the token refiner, then ``scatter_rows``
  builds the packed buffer (video / audio rows cast to the text dtype, uncovered rows zero);
* timestep: ``timestep_sinusoid`` -> ``timestep_mlp`` (FP32);
* each block: one ``adaln_table`` (FP32-held BF16 values; the six chunks are column views; a
  gradient-checkpointed block's recomputation takes the table its forward kept, :class:`KeptTable`),
  ``rms_norm_modulate``, q/k/v ``linear``, ``qk_norm_rope``, ``attention``, ``linear`` to_out,
  ``gate_residual``, and the same for the SwiGLU feed-forward. q, k and v are three ``linear``
  calls, also when diffusers' ``fuse_projections()`` made ``to_qkv`` (on its three row blocks):
  no weight copy per forward, gradients land in the parameters directly, and a fused model gives
  the same bits as an unfused one in the forward *and* the backward;
* output: ``final_adaln_out``, then ``gather_rows`` selects each modality's rows *before* the FP32
  heads (a GEMM row depends only on its input row, so this gives the same bits for less work).

RoPE cos/sin are computed as ``MiniMaxH3RotaryPosEmbed`` does, in elementwise FP32 torch from
``position_ids`` only, so they are the same bits in every batch.

The root forward reaches every module it calls directly (blocks, refiner blocks, ``norm_out``, the
refiner's ``final_norm``, ``time_embedder``, the input / output linears) through ``__call__``, as
diffusers does, so their hooks run (FSDP2 unshards parameters there); ``flowlock.patch`` routes
each of those forwards to the functions here (:mod:`flowlock.models.minimax_h3.patch`).

Unsupported modules (a Linear slot holding something else, a custom attention processor, LoRA with
active dropout or a variant such as DoRA) are found once per forward, before any op runs: strict
mode raises :class:`flowlock.StrictModeError` naming the module; audit mode records the fallback and
runs that module's own forward.
"""

from __future__ import annotations

import functools

import torch
from diffusers.models.activations import SwiGLU
from diffusers.models.attention import FeedForward
from diffusers.models.embeddings import TimestepEmbedding
from diffusers.models.modeling_utils import get_parameter_dtype
from diffusers.models.transformers.transformer_minimax_h3 import (
    MiniMaxH3AdaLayerNormOut,
    MiniMaxH3AttnProcessor,
    MiniMaxH3TokenRefinerBlock,
    MiniMaxH3TransformerBlock,
    MiniMaxH3TransformerOutput,
)
from torch import nn

from flowlock.models.common.diffusers_hooks import compute_param, leaf_hook_reason
from flowlock.models.common.module_class import module_class
from flowlock.models.common.peft_lora import is_peft_lora, lora_unsupported_reason, strict_lora_linear
from flowlock.models.common.run_context import STRICT_MARK, RunDecisions, call_with_run, is_strict, kept_slot
from flowlock.models.minimax_h3.context_parallel import sequence_plan
from flowlock.models.minimax_h3.guards import check_call
from flowlock.models.minimax_h3.skeleton import MODALITIES, block_body, refiner_body
from flowlock.models.minimax_h3.structure import validate_structure
from flowlock.modes import StrictModeError, fallback_or_raise
from flowlock.ops._kernel_op import kernel_op
from flowlock.ops._validate import memoized_over
from flowlock.ops.adaln import adaln_table, adaln_table_kept
from flowlock.ops.attention import attention
from flowlock.ops.final_adaln import final_adaln_out
from flowlock.ops.gate_residual import gate_residual
from flowlock.ops.linear import linear, linear_weight_grad
from flowlock.ops.qk_norm_rope import qk_norm_rope
from flowlock.ops.rms_norm import rms_norm, rms_norm_modulate
from flowlock.ops.rows import gather_rows, scatter_rows
from flowlock.ops.swiglu import swiglu
from flowlock.ops.timestep import timestep_mlp, timestep_sinusoid
from flowlock.parallel import UlyssesSequence


def rope_cos_sin(inv_freq: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``MiniMaxH3RotaryPosEmbed.forward``: (S, 3) positions -> cos, sin (S, 6 * rope_freq_dim) FP32.

    Elementwise FP32 from the positions only, the same ops in the same order as diffusers, so the
    result is bitwise equal to ``model.rope(position_ids)`` and independent of the batch.
    """
    freqs = position_ids.to(torch.float32).unsqueeze(-1) * inv_freq.view(1, 1, -1)
    freqs = torch.cat(freqs.unbind(dim=1), dim=-1)
    freqs = torch.cat((freqs, freqs), dim=-1)
    return freqs.cos(), freqs.sin()


@kernel_op("flowlock::h3_rope_cos_sin")
def compiled_rope_cos_sin(inv_freq: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rope_cos_sin` as one opaque node for ``torch.compile``: inductor would otherwise generate
    its own cos / sin (and fuse them), which are not eager's bits. Tables need no gradient."""
    return rope_cos_sin(inv_freq, position_ids)


@compiled_rope_cos_sin.register_fake
def _(inv_freq, position_ids):
    shape = (position_ids.shape[0], 6 * inv_freq.numel())
    return (position_ids.new_empty(shape, dtype=torch.float32), position_ids.new_empty(shape, dtype=torch.float32))


def _dropout_is_identity(module: nn.Module) -> bool:
    return isinstance(module, nn.Identity) or (isinstance(module, nn.Dropout)
                                               and (module.p == 0.0 or not module.training))


def _linear_reason(module: nn.Module, called: bool = False) -> str | None:
    # A module the strict path calls runs the hooks that wrap it; one it only reads must have none it can't serve.
    hooks = None if called else leaf_hook_reason(module)
    if module_class(module) is nn.Linear:
        return hooks
    if is_peft_lora(module):
        return hooks or lora_unsupported_reason(module)
    return f"{type(module).__name__} is neither torch.nn.Linear nor a peft LoRA Linear"


def _rms_norm_reason(module: nn.Module, called: bool = False) -> str | None:
    if module_class(module) is not nn.RMSNorm:
        return f"{type(module).__name__} is not torch.nn.RMSNorm"
    if module.weight is None or module.eps is None:
        return "RMSNorm without an affine weight or an explicit eps"
    return None if called else leaf_hook_reason(module)


class Run(RunDecisions):
    """One diffusers H3 forward's decisions (:class:`~flowlock.models.common.run_context.RunDecisions`),
    made before any op runs, and the Ulysses shards of its rows under context parallelism.

    The root forward hands its ``Run`` to the blocks it calls through :func:`call_with_run`, also on
    gradient-checkpointing recomputation, so a recomputed block makes the same decisions.
    """

    scope = "minimax_h3"

    def __init__(self, check_indices: bool, root: nn.Module, sequence: UlyssesSequence | None = None):
        super().__init__(check_indices, root)
        self.sequence = sequence

    @classmethod
    def for_model(cls, model: nn.Module, sequence: UlyssesSequence | None = None) -> Run:
        """Decisions for a whole-model forward whose structural inputs were validated; ``sequence``:
        its Ulysses shards under diffusers context parallelism."""
        run = cls(check_indices=False, root=model, sequence=sequence)
        for block in model.token_refiner.refiner_blocks:
            run._check_refiner_block(block)
        run._check(model.token_refiner.final_norm, _rms_norm_reason(model.token_refiner.final_norm, called=True))
        for block in model.transformer_blocks:
            run._check_block(block)
        for module in (model.proj_in, model.audio_proj_in, model.context_embedder, model.proj_out,
                       model.audio_proj_out):
            run._check(module, _linear_reason(module, called=is_strict(module)))
        # The rope tables are computed from its inv_freq buffer without calling it.
        run._check(model.rope, leaf_hook_reason(model.rope))
        run._check_norm_out(model.norm_out)
        run._check_time_embedder(model.time_embedder)
        if run.fallback and sequence is not None and sequence.exact_parameter_gradients:
            names = sorted(run.name(m) for m in model.modules() if id(m) in run.fallback)
            raise StrictModeError("exact parameter gradients under Ulysses need every module on flowlock's path; "
                                  f"these run their own forward (audit fallbacks): {', '.join(names)}")
        return run

    @classmethod
    def for_module(cls, module: nn.Module) -> Run:
        """Decisions for one patched submodule called on its own (indices not yet checked)."""
        run = cls(check_indices=True, root=module)
        if isinstance(module, MiniMaxH3TransformerBlock):
            run._check_block(module)
        elif isinstance(module, MiniMaxH3TokenRefinerBlock):
            run._check_refiner_block(module)
        elif isinstance(module, MiniMaxH3AdaLayerNormOut):
            run._check_norm_out(module)
        elif isinstance(module, TimestepEmbedding):
            run._check_time_embedder(module)
        elif isinstance(module, nn.RMSNorm):
            run._check(module, _rms_norm_reason(module, called=True))
        else:
            run._check(module, _linear_reason(module, called=True))
        return run

    def _check_time_embedder(self, embedder: nn.Module) -> None:
        kinds = [module_class(m) for m in (embedder, embedder.linear_1, embedder.linear_2, embedder.act)]
        if (kinds != [TimestepEmbedding, nn.Linear, nn.Linear, nn.SiLU] or embedder.cond_proj is not None
                or embedder.post_act is not None):
            self._check(embedder, "time_embedder is not linear_1 -> SiLU -> linear_2")
            return
        for linear_ in (embedder.linear_1, embedder.linear_2):
            self._check(linear_, leaf_hook_reason(linear_), fallback=embedder)

    def _check_refiner_block(self, block: nn.Module) -> None:
        self._check_attention(block.attn)
        self._check_ff(block.ff)
        for norm in (block.norm1, block.norm2):
            self._check(norm, _rms_norm_reason(norm))

    def _check_block(self, block: nn.Module) -> None:
        self._check_refiner_block(block)
        proj = block.adaln_proj.linear
        reason = leaf_hook_reason(proj) if module_class(proj) is nn.Linear else (
            "the AdaLN projection must be torch.nn.Linear (its table is built by adaln_table)")
        self._check(proj, reason, fallback=block)

    def _check_norm_out(self, norm_out: nn.Module) -> None:
        if module_class(norm_out.norm) is not nn.RMSNorm or module_class(norm_out.linear) is not nn.Linear:
            # final_adaln_out fuses the norm and its projection, so neither can be swapped alone.
            self._check(norm_out, "norm_out.norm / norm_out.linear must be RMSNorm / Linear")
            return
        for leaf in (norm_out.norm, norm_out.linear):
            self._check(leaf, leaf_hook_reason(leaf), fallback=norm_out)

    def _check_attention(self, attn: nn.Module) -> None:
        processor = attn.processor
        if module_class(processor) is not MiniMaxH3AttnProcessor:
            self._check(attn, f"attention processor {type(processor).__name__} is not diffusers' "
                        "MiniMaxH3AttnProcessor")
            return
        if processor._parallel_config is not None and self.sequence is None:
            self._check(attn, "context-parallel attention is on the strict path only inside the model's forward")
            return
        if not _dropout_is_identity(attn.to_out[1]):
            self._check(attn, "attention output dropout is active")
            return
        projections = [attn.to_qkv] if getattr(attn, "fused_projections", False) else [
            attn.to_q, attn.to_k, attn.to_v]
        for module in (*projections, attn.to_out[0]):
            self._check(module, _linear_reason(module))
        for norm in (attn.norm_q, attn.norm_k):
            self._check(norm, _rms_norm_reason(norm))

    def _check_ff(self, ff: nn.Module) -> None:
        net = getattr(ff, "net", None)
        if (module_class(ff) is not FeedForward or len(net) != 3 or module_class(net[0]) is not SwiGLU
                or not _dropout_is_identity(net[1])):
            self._check(ff, "feed-forward is not SwiGLU -> Dropout(0) -> Linear")
            return
        for module in (net[0].proj, net[2]):
            self._check(module, _linear_reason(module))

    def exact(self, sharded_rows: bool) -> UlyssesSequence | None:
        """The Ulysses sequence whose ops take one process's parameter gradients from all rows
        (``context_parallel.exact_parameter_gradients``), for an op on sharded rows; else None."""
        if sharded_rows and self.sequence is not None and self.sequence.exact_parameter_gradients:
            return self.sequence
        return None

    def linear(self, module: nn.Module, x: torch.Tensor, sharded_rows: bool = False) -> torch.Tensor:
        exact = self.exact(sharded_rows)
        if self.runs_own(module):
            return module(x)
        if module_class(module) is nn.Linear:
            return _linear(x, compute_param(module, "weight"), compute_param(module, "bias"), exact)
        # a LoRA layer's base, A and B GEMMs each take their weights' gradients from all rows under exact
        return strict_lora_linear(module, x, lambda rows, weight, bias=None: _linear(rows, weight, bias, exact))

    def rms_norm(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.runs_own(module):
            return module(x)
        return rms_norm(x, compute_param(module, "weight"), module.eps)

    def attention(self, attn: nn.Module, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                  sharded_rows: bool) -> torch.Tensor:
        """``MiniMaxH3AttnProcessor``: (B, S, hidden) bf16 -> (B, S, hidden) bf16.

        ``sharded_rows``: ``x`` holds this rank's rows of a sequence split by context parallelism
        (the transformer blocks), so the attention exchanges rows for heads; the token refiner's rows
        are replicated on every rank and its attention stays local. Decided by the caller, not by the
        module's identity, so torch.compile keeps one graph per block class.
        """
        if self.runs_own(attn):
            return attn(x, rope)
        if getattr(attn, "fused_projections", False):
            q, k, v = self._fused_qkv(attn.to_qkv, x, sharded_rows)
        else:
            q, k, v = (self.linear(m, x, sharded_rows) for m in (attn.to_q, attn.to_k, attn.to_v))
        q, k, v = (t.unflatten(-1, (attn.heads, -1)) for t in (q, k, v))
        if rope is None:
            q, k = self.rms_norm(attn.norm_q, q), self.rms_norm(attn.norm_k, k)
        else:
            q, k = (self._qk_norm_rope(norm, t, rope, sharded_rows) for norm, t in ((attn.norm_q, q), (attn.norm_k, k)))
        if sharded_rows and self.sequence is not None:
            out = self.sequence.attention(attention, q, k, v)
        else:
            out = attention(q, k, v)
        return self.linear(attn.to_out[0], out.flatten(2, 3), sharded_rows)

    def _fused_qkv(self, to_qkv: nn.Module, x: torch.Tensor, sharded_rows: bool) -> tuple[torch.Tensor, ...]:
        if module_class(to_qkv) is nn.Linear and not self.runs_own(to_qkv):
            # Three GEMMs on the row blocks of the stacked weight (contiguous views; the split's
            # backward is one exact concatenation): the same nodes as an unfused model, so forward
            # and gradients are bitwise those of the separate projections. One fused GEMM would
            # give the same forward but reduce dX over all 3·inner columns at once, which rounds
            # differently from autograd's sum of three dX partials.
            weight, bias = compute_param(to_qkv, "weight"), compute_param(to_qkv, "bias")
            biases = bias.chunk(3) if bias is not None else (None, None, None)
            exact = self.exact(sharded_rows)
            return tuple(_linear(x, w, b, exact) for w, b in zip(weight.chunk(3), biases))
        q, k, v = self.linear(to_qkv, x, sharded_rows).chunk(3, dim=-1)
        return q.contiguous(), k.contiguous(), v

    def _qk_norm_rope(self, norm: nn.Module, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                      sharded_rows: bool = False):
        exact = self.exact(sharded_rows)
        if self.runs_own(norm):
            from diffusers.models.transformers.transformer_minimax_h3 import _apply_rotary_emb

            return _apply_rotary_emb(norm(x), *rope)
        weight, eps = compute_param(norm, "weight"), norm.eps
        if exact is None:
            return qk_norm_rope(x, weight, rope[0], rope[1], eps)
        return exact.exact(lambda t, c, s, w: qk_norm_rope(t, w, c, s, eps), [(x, 1), (rope[0], 0), (rope[1], 0)],
                           [weight], out_dim=1)

    def feed_forward(self, ff: nn.Module, x: torch.Tensor, sharded_rows: bool = False) -> torch.Tensor:
        if self.runs_own(ff):
            return ff(x)
        return self.linear(ff.net[2], swiglu(self.linear(ff.net[0].proj, x, sharded_rows)), sharded_rows)


def _linear_weight_grads(rows_all, dout_all, replicated, needs):
    dw, db = linear_weight_grad(rows_all[0], dout_all, *replicated)
    return [dw if needs[0] else None, db if needs[1] else None]


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            exact: UlyssesSequence | None) -> torch.Tensor:
    if exact is None:
        return linear(x, weight, bias)
    # dW / dBias over all rows by the backward's own kernels (no forward recomputation)
    return exact.exact(linear, [(x, x.ndim - 2)], [weight, bias], out_dim=x.ndim - 2, rep_grads=_linear_weight_grads)


def _call_linear(run: Run, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # diffusers' load_lora_adapter / add_adapter after patching put a peft layer into the slot (the
    # patched Linear is its base layer): it has no strict forward, so the strict path reads it instead.
    return call_with_run(run, module, x) if is_strict(module) else run.linear(module, x)


class KeptTable:
    """The AdaLN table of one gradient-checkpointed block call, kept from its forward (``(3T, 6H)``
    fp32, 387 KB a block at H3's widths and T = 1) and handed once to its recomputation, which then
    does not stream the block's ``18H x E`` projection weight again (520 MB). The values are the same
    bits a recomputation would produce, and the node they go into has :func:`adaln_table`'s backward
    (:func:`flowlock.ops.adaln.adaln_table_kept`), so outputs and gradients do not change."""

    __slots__ = ("table",)

    def __init__(self):
        self.table: torch.Tensor | None = None


class _RefinerSteps:
    """The diffusers steps of a token-refiner block (:class:`~flowlock.models.minimax_h3.skeleton.RefinerSteps`):
    replicated text rows, so attention stays local under context parallelism."""

    def __init__(self, run: Run, block: nn.Module):
        self.run, self.block = run, block

    def norm(self, norm, x):
        return self.run.rms_norm(norm, x)

    def attend(self, x):
        return self.run.attention(self.block.attn, x, None, sharded_rows=False)

    def feed_forward(self, x):
        return self.run.feed_forward(self.block.ff, x)


def refiner_block_forward(run: Run, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``MiniMaxH3TokenRefinerBlock.forward`` on flowlock ops: (B, Nt, hidden) bf16 -> same."""
    return refiner_body(_RefinerSteps(run, block), block, x)


class _BlockSteps:
    """The diffusers steps of a DiT block (:class:`~flowlock.models.minimax_h3.skeleton.BlockSteps`):
    peft LoRA and hooks served through :class:`Run`, the rows sharded under context parallelism."""

    def __init__(self, run: Run, block: nn.Module, temb: torch.Tensor, rotary_emb: tuple[torch.Tensor, torch.Tensor]):
        self.run, self.block, self.temb, self.rotary_emb = run, block, temb, rotary_emb

    def table(self):
        return _block_table(self.block.adaln_proj.linear, self.temb)

    def modulate(self, norm, x, shift, scale, index):
        return _modulate(self.run, norm, x, shift, scale, index)

    def attend(self, x):
        return self.run.attention(self.block.attn, x, self.rotary_emb, sharded_rows=True)

    def feed_forward(self, x):
        return self.run.feed_forward(self.block.ff, x, sharded_rows=True)

    def gate(self, x, gate, y, index):
        return _gate_residual(self.run, x, gate, y, index)


def block_forward(run: Run, block: nn.Module, x: torch.Tensor, temb: torch.Tensor, adaln_indices: torch.Tensor,
                  rotary_emb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``MiniMaxH3TransformerBlock.forward`` on flowlock ops: x (B, S, hidden) bf16, temb (T, E) fp32,
    adaln_indices (S,) in [0, 3T), rotary_emb (cos, sin) (S, R) fp32 -> (B, S, hidden) bf16."""
    return block_body(_BlockSteps(run, block, temb, rotary_emb), block, x, adaln_indices)


def _block_table(proj: nn.Module, temb: torch.Tensor) -> torch.Tensor:
    # A checkpointed call's forward keeps its table for the recomputation (KeptTable); a compiled
    # block recomputes it, since its graph would otherwise specialize on the slot's state.
    weight, bias = compute_param(proj, "weight"), compute_param(proj, "bias")
    kept = None if torch.compiler.is_compiling() else kept_slot()
    if kept is None:
        return adaln_table(temb, weight, bias)
    if kept.table is None:
        table = adaln_table(temb, weight, bias)
        kept.table = table.detach()
        return table
    # Handed over once: a second recomputation (a retained graph's second backward) computes it again.
    table, kept.table = kept.table, None
    return adaln_table_kept(table, temb, weight, bias)


def _gate_residual(run: Run, x, gate, y, index):
    exact, check = run.exact(sharded_rows=True), run.check_indices
    if exact is None:
        return gate_residual(x, gate, y, index, check_indices=check)
    return exact.exact(lambda r, t, i, g: gate_residual(r, g, t, i, check_indices=check), [(x, 1), (y, 1), (index, 0)],
                       [gate], out_dim=1)


def norm_out_forward(run: Run, norm_out: nn.Module, x: torch.Tensor, temb: torch.Tensor,
                     timestep_indices: torch.Tensor) -> torch.Tensor:
    """``MiniMaxH3AdaLayerNormOut.forward`` on ``final_adaln_out``: (B, S, hidden) bf16 -> same."""
    norm, proj = norm_out.norm, norm_out.linear
    params = [compute_param(norm, "weight"), compute_param(proj, "weight"), compute_param(proj, "bias")]
    exact, check, eps = run.exact(sharded_rows=True), run.check_indices, norm.eps
    if exact is None:
        return final_adaln_out(x, temb, *params, timestep_indices, eps, check_indices=check)
    return exact.exact(lambda t, i, e, nw, w, b: final_adaln_out(t, e, nw, w, b, i, eps, check_indices=check),
                       [(x, 1), (timestep_indices, 0)], [temb, *params], out_dim=1)


def _modulate(run: Run, norm: nn.Module, x, shift, scale, index):
    exact = run.exact(sharded_rows=True)
    if run.runs_own(norm):
        return norm(x) * (1.0 + scale.to(x.dtype)[index]) + shift.to(x.dtype)[index]
    weight, eps, check = compute_param(norm, "weight"), norm.eps, run.check_indices
    if exact is None:
        return rms_norm_modulate(x, weight, shift, scale, index, eps, check_indices=check)
    return exact.exact(lambda t, i, w, sh, sc: rms_norm_modulate(t, w, sh, sc, i, eps, check_indices=check),
                       [(x, 1), (index, 0)], [weight, shift, scale], out_dim=1)


def _call_block(owner: nn.Module, run: Run, block: nn.Module, *args):
    # As diffusers: checkpoint each block when the owner asks for it; the Run travels with the call so
    # recomputation during backward makes the same decisions, and so does the block's kept AdaLN table.
    if torch.is_grad_enabled() and owner.gradient_checkpointing:
        return owner._gradient_checkpointing_func(functools.partial(call_with_run, run, block, kept=KeptTable()), *args)
    return call_with_run(run, block, *args)


def _time_embedding(run: Run, model: nn.Module, timestep: torch.Tensor) -> torch.Tensor:
    proj = model.time_proj
    if proj.num_channels < 2 or proj.num_channels % 2 or not proj.flip_sin_to_cos \
            or proj.downscale_freq_shift != 0 or proj.scale != 1:
        fallback_or_raise("minimax_h3 time_proj", "timestep_sinusoid serves Timesteps(C, flip_sin_to_cos=True, "
                          f"downscale_freq_shift=0, scale=1) with an even C only, got C={proj.num_channels}, "
                          f"flip_sin_to_cos={proj.flip_sin_to_cos}, downscale_freq_shift={proj.downscale_freq_shift}, "
                          f"scale={proj.scale}")
        sinusoid = proj(timestep)
    else:
        # validate_structure checked the range already (in the graph, when compiling).
        sinusoid = timestep_sinusoid(timestep, channels=proj.num_channels, check_range=False)
    return call_with_run(run, model.time_embedder, sinusoid)


def time_embedder_forward(run: Run, embedder: nn.Module, sample: torch.Tensor) -> torch.Tensor:
    """``TimestepEmbedding.forward`` on ``timestep_mlp``: (T, freq_dim) fp32 -> (T, E) fp32."""
    l1, l2 = embedder.linear_1, embedder.linear_2
    return timestep_mlp(sample, *(compute_param(m, n) for m in (l1, l2) for n in ("weight", "bias")))


def strict_forward(model: nn.Module, hidden_states: torch.Tensor, audio_hidden_states: torch.Tensor,
                   encoder_hidden_states: torch.Tensor, timestep: torch.Tensor, timestep_indices: torch.Tensor,
                   token_tags: torch.Tensor, position_ids: torch.Tensor, video_indices: torch.Tensor,
                   audio_indices: torch.Tensor, text_indices: torch.Tensor, return_dict: bool = True):
    """``MiniMaxH3Transformer3DModel.forward`` on flowlock ops; its arguments (``attention_kwargs`` aside),
    its outputs.

    Shapes as diffusers: video rows ``(B, Nv, C_video)``, audio rows ``(B, Na, C_audio)``, text
    ``(B, Nt, text_dim)``, ``timestep (T,)`` float32 in [0, 1], per-row ``timestep_indices`` /
    ``token_tags (S,)``, ``position_ids (S, 3)`` and unique, disjoint row indices. Returns
    :class:`MiniMaxH3TransformerOutput` (``sample`` (B, Nv, C_video) and ``audio_sample``
    (B, Na, C_audio), FP32) or the tuple when ``return_dict=False``.

    Guarantees: every output and gradient element is a pure function of its sample (batch
    invariance) and bitwise repeatable, given the ops' contracts. The structural inputs are
    validated once, here, before any op runs (ValueError / TypeError naming the argument), and so are
    the model's dtypes and devices and the latents' finiteness (:mod:`flowlock.models.minimax_h3.guards`).
    """
    seq_len = validate_structure(
        hidden_states=hidden_states, audio_hidden_states=audio_hidden_states,
        encoder_hidden_states=encoder_hidden_states, timestep=timestep, timestep_indices=timestep_indices,
        token_tags=token_tags, position_ids=position_ids, video_indices=video_indices,
        audio_indices=audio_indices, text_indices=text_indices)
    # before any op: the model's dtypes / devices against its patch, NaN / Inf in the latents (one sync)
    check_call(model, hidden_states, audio_hidden_states, encoder_hidden_states)
    sequence = sequence_plan(model, [position_ids, timestep_indices, token_tags, video_indices, audio_indices,
                                     text_indices], hidden_states.shape[0], STRICT_MARK)
    run = Run.for_model(model, sequence)

    inv_freq = model.rope.inv_freq
    if run.runs_own(model.rope):
        cos, sin = model.rope(position_ids)
    elif torch.compiler.is_compiling():
        # The memo compares storage pointers, which a graph cannot; compiled, the tables are one graph node.
        cos, sin = compiled_rope_cos_sin(inv_freq, position_ids)
    else:
        # Seven small launches per forward otherwise; a layout's positions are reused every step.
        cos, sin = memoized_over([position_ids, inv_freq], "rope_cos_sin",
                                 lambda: rope_cos_sin(inv_freq, position_ids))

    video = _call_linear(run, model.proj_in, hidden_states.to(get_parameter_dtype(model.proj_in)))
    audio = _call_linear(run, model.audio_proj_in, audio_hidden_states.to(get_parameter_dtype(model.audio_proj_in)))
    text = _call_linear(run, model.context_embedder,
                         encoder_hidden_states.to(get_parameter_dtype(model.context_embedder)))
    refiner = model.token_refiner
    for block in refiner.refiner_blocks:
        text = _call_block(refiner, run, block, text)
    text = call_with_run(run, refiner.final_norm, text)

    x = scatter_rows([text, video.to(text.dtype), audio.to(text.dtype)],
                     [text_indices, video_indices, audio_indices], seq_len, check_indices=False)

    temb = _time_embedding(run, model, timestep)
    adaln_indices = timestep_indices * MODALITIES + token_tags

    if sequence is not None:
        x, adaln_indices, cos, sin, timestep_indices = (sequence.shard(t, dim) for t, dim in (
            (x, 1), (adaln_indices, 0), (cos, 0), (sin, 0), (timestep_indices, 0)))
    for block in model.transformer_blocks:
        x = _call_block(model, run, block, x, temb, adaln_indices, (cos, sin))
    x = call_with_run(run, model.norm_out, x, temb, timestep_indices)
    if sequence is not None:
        x = sequence.gather(x, 1)
    # diffusers casts to proj_out's dtype for both heads; gathering first moves the same cast.
    head_dtype = get_parameter_dtype(model.proj_out)
    video_rows = gather_rows(x, video_indices, check_indices=False).to(head_dtype)
    audio_rows = gather_rows(x, audio_indices, check_indices=False).to(head_dtype)
    video_out = _call_linear(run, model.proj_out, video_rows)
    audio_out = _call_linear(run, model.audio_proj_out, audio_rows)
    if not return_dict:
        return (video_out, audio_out)
    return MiniMaxH3TransformerOutput(sample=video_out, audio_sample=audio_out)
