"""The strict forward of vLLM-Omni's native ``MiniMaxH3DiTModel``, built only from flowlock ops.

It computes what ``minimax_h3_transformer.py`` (vllm-omni 0.30.0) computes, and it calls the same
flowlock ops, on the same values, in the same order, as the diffusers strict path
(:mod:`flowlock.models.minimax_h3.strict`), so that with the same weights and inputs the two
engines give the same bits:

* embedding: ``gather_rows`` takes the video / audio rows out of ``x`` / ``audio_x``; the FP32
  patch projections and the BF16 ``condition_proj`` are ``linear``; the token refiner; then
  ``scatter_rows`` builds the packed rows (uncovered rows, padding included, are zero);
* timestep: ``timestep_sinusoid`` -> ``timestep_mlp`` on the distinct timesteps;
* each block: ``adaln_table`` (the AdaLN memo cache is never consulted: the table always comes
  from flowlock's own projection), ``rms_norm_modulate``, q, k and v as three ``linear`` on the row
  blocks of the fused ``qkv_proj`` weight (the bits of diffusers' separate projections), each
  with its LoRA slice added when vLLM-Omni wrapped the layer (:mod:`.lora`; out, fc1, fc2 too),
  ``qk_norm_rope``, ``attention`` once per document of ``cu_seqlens`` (a padding run is a document
  of its own, so padding never reaches a real row), ``linear`` out_proj, ``gate_residual``; the MLP
  is ``linear`` fc1, its [gate; up] halves put in diffusers' [value; gate] order for ``swiglu``,
  and ``linear`` fc2;
* output: ``final_adaln_out``, ``gather_rows`` of the returned rows *before* the FP32 heads (a GEMM
  row depends only on its input row), then the update masks as vLLM-Omni applies them.

RoPE comes from the positions as the diffusers strict path computes it; a caller's prepared BF16
``rope_table`` is used as given in a BF16 model (``qk_norm_rope`` rounds cos / sin to BF16 first, so a
table that vLLM-Omni prepared from the same positions gives the same bits); an FP32 model keeps
cos / sin FP32 as diffusers does, so there the table is checked against the positions and RoPE comes
from the positions (:func:`_model_rope`).

vLLM's linears return ``(output, bias)``; the patched linears keep that convention.

Under Ulysses (``run.sp``) the DiT blocks run on row shards (see
:mod:`flowlock.integrations.vllm_omni.minimax_h3.sequence_parallel`). At TP > 1 (``run.tp``, set up by
install()) the GEMMs over vLLM's weight shards go through
:mod:`flowlock.integrations.vllm_omni.minimax_h3.tensor_parallel`, which gives the TP = 1 bits. At degree 1
``run.sp`` and ``run.tp`` are None and none of their code or collectives run.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from flowlock.integrations.vllm_omni.lora import add_lora
from flowlock.integrations.vllm_omni.minimax_h3.coverage import NativeRun
from flowlock.integrations.vllm_omni.minimax_h3.inputs import documents, parse_inputs
from flowlock.models.common.run_context import call_with_run
from flowlock.models.minimax_h3.skeleton import MODALITIES, block_body, refiner_body
from flowlock.models.minimax_h3.strict import rope_cos_sin
from flowlock.modes import mode
from flowlock.ops._validate import memoized_over
from flowlock.ops.adaln import adaln_table
from flowlock.ops.attention import attention
from flowlock.ops.final_adaln import final_adaln_out
from flowlock.ops.gate_residual import gate_residual
from flowlock.ops.linear import linear
from flowlock.ops.qk_norm_rope import qk_norm_rope
from flowlock.ops.rms_norm import rms_norm, rms_norm_modulate
from flowlock.ops.rows import gather_rows, scatter_rows
from flowlock.ops.swiglu import swiglu
from flowlock.ops.timestep import timestep_mlp, timestep_sinusoid
from flowlock.parallel.ulysses import UlyssesSequence


class RopeTables(NamedTuple):
    """``(S, R)`` float32 cos and sin, as :func:`flowlock.models.minimax_h3.strict.rope_cos_sin` builds."""

    cos: torch.Tensor
    sin: torch.Tensor


def rope_from_table(table: torch.Tensor) -> RopeTables:
    """vLLM-Omni's ``(S, R)`` BF16 ``[cos | sin]`` table (each over ``R / 2`` frequencies) as full-width
    FP32 cos / sin (each half repeated, as rotate-half uses them); exact, memoized per table."""

    def expand() -> RopeTables:
        cos, sin = table.float().chunk(2, dim=-1)
        return RopeTables(torch.cat((cos, cos), -1), torch.cat((sin, sin), -1))

    return memoized_over([table], "h3_rope_expand", expand)


def _native_table(rope: RopeTables) -> torch.Tensor:
    """The BF16 table vLLM-Omni builds from the same frequencies (for a module's own forward)."""
    half = rope.cos.shape[-1] // 2
    return torch.cat((rope.cos[..., :half], rope.sin[..., :half]), dim=-1).to(torch.bfloat16)


def _rope(rope_table) -> RopeTables:
    return rope_table if isinstance(rope_table, RopeTables) else rope_from_table(rope_table)


def linear_forward(run: NativeRun, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A vLLM linear's output tensor: flowlock ``linear`` unless this module runs its own forward."""
    if run.runs_own(module):
        return module(x)[0]
    if run.tp is not None:
        return run.tp.gathered_linear(module, x)
    return linear(x, module.weight, module.bias)


def _base_weight(module: nn.Module) -> torch.Tensor:
    return getattr(module, "base_layer", module).weight


def _project(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A bias-free block linear (out_proj, fc2), its LoRA added if wrapped."""
    return add_lora(module, x, [linear(x, _base_weight(module))])[0]


def attention_forward(run: NativeRun, attn: nn.Module, x: torch.Tensor, rope: RopeTables | None,
                      docs: tuple[tuple[int, int], ...], own_kwargs: dict,
                      sequence: UlyssesSequence | None = None) -> torch.Tensor:
    """``MiniMaxH3Attention``: x ``(T, hidden)`` bf16 -> ``(T, hidden)`` bf16, attending within ``docs``.

    With ``sequence`` (Ulysses), x holds this rank's row shard and ``docs`` index the whole packed
    sequence: an all-to-all gives each rank every row of its heads around the attention."""
    if run.runs_own(attn):
        table = None if rope is None else _native_table(rope)
        return attn(x, rope_table=table, **own_kwargs)
    total, inner = x.shape[0], attn.num_heads * attn.head_dim
    # Three GEMMs on the row blocks [q; k; v] of the fused weight: the nodes of diffusers' separate
    # to_q / to_k / to_v, so the bits of both engines' projections are the same.
    qkv = [linear(x, w) for w in _base_weight(attn.qkv_proj).split(inner)]
    q, k, v = (t.view(1, total, attn.num_heads, attn.head_dim) for t in add_lora(attn.qkv_proj, x, qkv))
    if rope is None:
        q, k = (rms_norm(t, norm.weight, norm.variance_epsilon) for norm, t in ((attn.q_norm, q), (attn.k_norm, k)))
    else:
        q, k = (qk_norm_rope(t, norm.weight, rope.cos, rope.sin, norm.variance_epsilon)
                for norm, t in ((attn.q_norm, q), (attn.k_norm, k)))
    # diffusers' default scale 1/sqrt(D) (coverage checked the module's D ** -0.5 equals it to 1e-12).

    def attend(q, k, v):
        parts = [attention(q[:, a:b], k[:, a:b], v[:, a:b]) for a, b in docs]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    out = (attend(q, k, v) if sequence is None else sequence.attention(attend, q, k, v)).view(total, inner)
    if run.tp is not None:
        return run.tp.k_sharded_linear(attn.out_proj, out)
    return _project(attn.out_proj, out)


def _norm(run: NativeRun, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if run.runs_own(norm):
        return norm(x)
    return rms_norm(x, norm.weight, norm.variance_epsilon)


def mlp_forward(run: NativeRun, mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``MiniMaxH3MLP``: fc1 -> SiLU-and-mul -> fc2 on ``(T, hidden)`` bf16."""
    if run.runs_own(mlp):
        return mlp(x)
    h = linear(x, _base_weight(mlp.fc1))
    # native fc1 rows are [gate; up], diffusers' SwiGLU wants [value; gate]: permuting GEMM columns
    # is exact, and swiglu's value * silu(gate) is the bits of vLLM's silu(gate) * up.
    gate, up = add_lora(mlp.fc1, x, list(h.chunk(2, dim=-1)))
    act = swiglu(torch.cat((up, gate), dim=-1))
    if run.tp is not None:
        return run.tp.k_sharded_linear(mlp.fc2, act)
    return _project(mlp.fc2, act)


def refiner_block_forward(run: NativeRun, block: nn.Module, x: torch.Tensor, *, cu_seqlens: torch.Tensor,
                          max_seqlen: int, num_requests: int = 1) -> torch.Tensor:
    """``MiniMaxH3TokenRefinerBlock.forward``: text rows ``(Nt, hidden)`` bf16 -> same."""
    docs = documents(cu_seqlens, max_seqlen, x.shape[0], prefix_request=num_requests == 1,
                     name="refiner cu_seqlens")
    own = dict(cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, num_requests=num_requests)
    return refiner_body(_RefinerSteps(run, block, docs, own), block, x)


class _RefinerSteps:
    """The vLLM-Omni steps of a token-refiner block (:class:`~flowlock.models.minimax_h3.skeleton.RefinerSteps`):
    attention within the refiner's documents, no RoPE, never sharded."""

    def __init__(self, run: NativeRun, block: nn.Module, docs: tuple[tuple[int, int], ...], own: dict):
        self.run, self.block, self.docs, self.own = run, block, docs, own

    def norm(self, norm, x):
        return _norm(self.run, norm, x)

    def attend(self, x):
        return attention_forward(self.run, self.block.attn, x, None, self.docs, self.own)

    def feed_forward(self, x):
        return mlp_forward(self.run, self.block.mlp, x)


def refiner_forward(run: NativeRun, refiner: nn.Module, x: torch.Tensor, *, cu_seqlens: torch.Tensor,
                    max_seqlen: int, num_requests: int = 1) -> torch.Tensor:
    """``MiniMaxH3TokenRefiner.forward``: each block through ``__call__``, then the final RMSNorm."""
    for block in refiner.blocks:
        x = call_with_run(run, block, x, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, num_requests=num_requests)
    return _norm(run, refiner.final_norm, x)


def block_forward(run: NativeRun, block: nn.Module, x: torch.Tensor, *, t_emb: torch.Tensor,
                  combined_indices: torch.Tensor, rope_table, cu_seqlens: torch.Tensor, max_seqlen: int,
                  packed_total: int, num_requests: int = 1, sp_seq_lens=None, video_layout=None,
                  vsa_prefix_segments=()) -> torch.Tensor:
    """``MiniMaxH3DiTBlock.forward``: x ``(T, hidden)`` bf16, t_emb ``(M, E)`` fp32, combined_indices
    ``(T,)`` in ``[0, 3M)``, rope_table vLLM-Omni's ``(T, R)`` bf16 table or :class:`RopeTables`."""
    if x.shape[0] != packed_total and run.sequence is None:
        raise ValueError(f"x has {x.shape[0]} rows for packed_total {packed_total}: sequence-parallel shards "
                         "are not on the strict path")
    docs = documents(cu_seqlens, max_seqlen, packed_total, prefix_request=num_requests == 1)
    own = dict(cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, packed_total=packed_total, num_requests=num_requests,
               sp_seq_lens=sp_seq_lens, video_layout=video_layout, vsa_prefix_segments=vsa_prefix_segments)
    return block_body(_BlockSteps(run, block, t_emb, _rope(rope_table), docs, own), block, x, combined_indices)


class _BlockSteps:
    """The vLLM-Omni steps of a DiT block (:class:`~flowlock.models.minimax_h3.skeleton.BlockSteps`):
    vLLM's parameters read directly, TP > 1 and Ulysses through ``run.tp`` / ``run.sequence``, attention
    within the packed documents."""

    def __init__(self, run: NativeRun, block: nn.Module, t_emb: torch.Tensor, rope: RopeTables,
                 docs: tuple[tuple[int, int], ...], own: dict):
        self.run, self.block, self.t_emb, self.rope, self.docs, self.own = run, block, t_emb, rope, docs, own

    def table(self):
        proj = self.block.adaln_proj.linear
        if self.run.tp is None:
            return adaln_table(self.t_emb, proj.weight, proj.bias)
        return self.run.tp.adaln_table(self.t_emb, proj)

    def modulate(self, norm, x, shift, scale, index):
        return rms_norm_modulate(x, norm.weight, shift, scale, index, norm.variance_epsilon,
                                 check_indices=self.run.check_indices)

    def attend(self, x):
        return attention_forward(self.run, self.block.attn, x, self.rope, self.docs, self.own, self.run.sequence)

    def feed_forward(self, x):
        return mlp_forward(self.run, self.block.mlp, x)

    def gate(self, x, gate, y, index):
        return gate_residual(x, gate, y, index, check_indices=self.run.check_indices)


def time_embedder_forward(run: NativeRun, embedder: nn.Module, t: torch.Tensor) -> torch.Tensor:
    """``MiniMaxH3TimeEmbedder.forward``: ``(M,)`` float32 in [0, 1] -> ``(M, E)`` float32 (a sinusoid of
    ``frequency_embedding_size`` channels, cos first, as diffusers' ``Timesteps`` of that width)."""
    p, q = embedder.proj_in, embedder.proj_out
    weights = (p.weight, p.bias, q.weight, q.bias) if run.tp is None else run.tp.time_embedder_weights(embedder)
    sinusoid = timestep_sinusoid(t, channels=embedder.frequency_embedding_size, check_range=run.check_indices)
    return timestep_mlp(sinusoid, *weights)


def _final_rows(run: NativeRun, final: nn.Module, x: torch.Tensor, t_emb: torch.Tensor,
                inverse_indices: torch.Tensor, check: bool) -> torch.Tensor:
    """``final_layer``'s modulated rows ``(1, T, hidden)`` bf16, before the heads."""
    ada = final.adaln_proj.linear
    weight, bias = (ada.weight, ada.bias) if run.tp is None else run.tp.final_adaln_weights(final)
    return final_adaln_out(x.unsqueeze(0), t_emb, final.norm.weight, weight, bias, inverse_indices,
                           final.norm.variance_epsilon, check_indices=check)


def final_layer_forward(run: NativeRun, final: nn.Module, x: torch.Tensor, *, t_emb: torch.Tensor,
                        inverse_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``MiniMaxH3FinalLayer.forward``: ``(T, hidden)`` bf16 -> both FP32 heads on every row."""
    h = _final_rows(run, final, x, t_emb, inverse_indices, run.check_indices)[0].to(final.video_out.weight.dtype)
    return call_with_run(run, final.video_out, h)[0], call_with_run(run, final.audio_out, h)[0]


def _model_rope(model: nn.Module, inputs) -> RopeTables:
    """RoPE cos / sin for the packed rows: from the positions, or from vLLM-Omni's prepared table.

    The table is always BF16 (vLLM-Omni builds it so and its forward refuses another dtype). Where
    the attention runs in BF16, ``qk_norm_rope`` rounds cos / sin to BF16 first, so the table gives
    the positions' bits and is used as given. In an FP32 (or FP16) model cos / sin stay FP32 (or round
    to FP16), as diffusers computes them: the BF16 table would round them to BF16, so RoPE comes from
    ``img_position_ids`` and the table is only checked (once per table) to be the BF16 table of those
    positions; any other raises ValueError."""
    inv_freq, positions = model.rope.inv_freq, inputs.img_position_ids

    def from_positions() -> RopeTables:
        return RopeTables(*memoized_over([positions, inv_freq], "rope_cos_sin",
                                         lambda: rope_cos_sin(inv_freq, positions[0])))

    table = inputs.rope_table
    if table is None:
        return from_positions()
    if not model.blocks or _base_weight(model.blocks[0].attn.qkv_proj).dtype == torch.bfloat16:
        return rope_from_table(table)
    rope = from_positions()
    if not memoized_over([table, positions, inv_freq], "h3_rope_table_of_positions",
                         lambda: torch.equal(table, _native_table(rope))):
        raise ValueError("rope_table is not the BF16 table vLLM-Omni prepares from img_position_ids; a model not in "
                         "BF16 takes RoPE from the positions, at FP32 (a BF16 table would round cos / sin)")
    return rope


def model_forward(model: nn.Module, kwargs: dict, own_forward) -> tuple[torch.Tensor, torch.Tensor]:
    """``MiniMaxH3DiTModel.forward(**kwargs)`` on flowlock ops: ``(video [No, C_video], audio [Na, C_audio])``
    FP32, the rows of ``img_pos_for_infer_output_info`` and ``audio_pos_info``, update masks applied.

    Inputs are validated first (:func:`flowlock.integrations.vllm_omni.minimax_h3.inputs.parse_inputs`), then
    coverage is decided for every module, both before any op runs. Guarantees: each request's
    outputs are a pure function of that request's rows (alone, packed with others, padded or not)
    and bitwise repeatable, given the ops' contracts.
    """
    inputs = parse_inputs(kwargs, model.video_patch_proj.input_size, model.audio_patch_proj.input_size)
    run = NativeRun.for_model(model)
    if run.runs_own(model):
        # a model-level refusal (audit): vLLM-Omni's path for the whole forward, submodules included
        with mode("provider"):
            return own_forward()
    s = inputs.seq_len
    rope = _model_rope(model, inputs)

    video = gather_rows(inputs.x, inputs.img_pos, check_indices=False)
    audio = gather_rows(inputs.audio_x, inputs.audio_pos, check_indices=False)
    video = call_with_run(run, model.video_patch_proj, video.to(model.video_patch_proj.weight.dtype))[0]
    audio = call_with_run(run, model.audio_patch_proj, audio.to(model.audio_patch_proj.weight.dtype))[0]
    text = inputs.prompt_embeds.to(model.condition_proj.weight.dtype)
    text = call_with_run(run, model.condition_proj, text)[0]
    text = call_with_run(run, model.token_refiner, text, cu_seqlens=inputs.refiner_cu_seqlens,
                         max_seqlen=inputs.refiner_max_seqlen, num_requests=inputs.num_requests)
    hidden = scatter_rows([text.unsqueeze(0), video.to(text.dtype), audio.to(text.dtype)],
                          [inputs.text_pos, inputs.img_pos, inputs.audio_pos], s, check_indices=False)[0]

    t_emb = call_with_run(run, model.time_embedder, inputs.unique_timesteps)
    combined = inputs.inverse_indices * MODALITIES + inputs.token_tags.clamp(min=0)
    if run.sp is not None:
        # Ulysses: the blocks run on this rank's rows (the embedding and the refiner ran on all rows)
        run.sequence = run.sp.sequence(model, s, inputs.num_requests, hidden.device)
        hidden, combined = run.sequence.shard(hidden, 0), run.sequence.shard(combined, 0)
        rope = RopeTables(run.sequence.shard(rope.cos, 0), run.sequence.shard(rope.sin, 0))
    for block in model.blocks:
        hidden = call_with_run(run, block, hidden, t_emb=t_emb, combined_indices=combined, rope_table=rope,
                               cu_seqlens=inputs.cu_seqlens, max_seqlen=inputs.max_seqlen, packed_total=s,
                               num_requests=inputs.num_requests)
    if run.sequence is not None:
        hidden = run.sequence.gather(hidden, 0)

    final = model.final_layer
    if run.runs_own(final):
        video, audio = final(hidden, t_emb=t_emb, inverse_indices=inputs.inverse_indices)
        video, audio = video.index_select(0, inputs.out_pos), audio.index_select(0, inputs.audio_pos)
    else:
        rows = _final_rows(run, final, hidden, t_emb, inputs.inverse_indices, check=False)
        head_dtype = final.video_out.weight.dtype
        video = gather_rows(rows, inputs.out_pos, check_indices=False)[0].to(head_dtype)
        audio = gather_rows(rows, inputs.audio_pos, check_indices=False)[0].to(head_dtype)
        video = call_with_run(run, final.video_out, video)[0]
        audio = call_with_run(run, final.audio_out, audio)[0]
    # vLLM-Omni's own masking (an elementwise product, as there): condition rows come back zero.
    if inputs.update_mask is not None:
        video = video * inputs.update_mask.unsqueeze(-1)
    if inputs.update_audio_mask is not None:
        audio = audio * inputs.update_audio_mask.unsqueeze(-1)
    return video, audio
