"""What the strict path can compute for a vLLM-Omni ``MiniMaxH3DiTModel``, decided before any op runs.

Served: vLLM's unquantized parallel linears at TP = 1, or at the TP degree install() set up
(:mod:`flowlock.integrations.vllm_omni.minimax_h3.tensor_parallel`), with H3's biases (patch, condition, time,
AdaLN and output projections biased; q/k/v, out, fc1, fc2 not), vLLM-Omni's diffusion LoRA wrappers
on q/k/v, out, fc1 and fc2 at any TP degree (:mod:`flowlock.integrations.vllm_omni.lora`), vLLM-Omni's
``RMSNorm``, and dense softmax attention whatever dense backend vLLM-Omni resolved (flowlock
replaces the backend call, so FLASH_ATTN, cuDNN, SDPA and the others give one answer). Not served,
each named with its module: a quantized linear, a bias where H3 has none (or none where it has
one), another layer type, a LoRA wrapper on any other linear (or one with several slots, fully
sharded, or in another dtype), a TP degree other than install()'s, sparse or approximate
attention backends (VSA, Sage, RainFusion, TRT-LLM), VSA gates, quantized KV, ring sequence
parallelism, a Ulysses degree other than install()'s, Cache-DiT and any vLLM-Omni hook (TeaCache,
offload; SP hooks other than the ``_sp_plan`` split / gather, which the strict forward never calls),
whose effect on the arithmetic the strict path cannot vouch for.

Strict mode raises :class:`flowlock.StrictModeError` at the first such module; audit mode records
it and lets that module run its own forward (for a model-level reason, the whole forward runs
vLLM-Omni's path, submodules included).
"""

from __future__ import annotations

import math

from torch import nn
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm_omni.diffusion.layers.norm import RMSNorm
from vllm_omni.diffusion.models.minimax_h3.minimax_h3_transformer import (
    MiniMaxH3Attention,
    MiniMaxH3DiTBlock,
    MiniMaxH3FinalLayer,
    MiniMaxH3MLP,
    MiniMaxH3TimeEmbedder,
    MiniMaxH3TokenRefiner,
    MiniMaxH3TokenRefinerBlock,
)

from flowlock.integrations.vllm_omni.layers import LINEAR_CLASSES
from flowlock.integrations.vllm_omni.lora import is_lora_layer, lora_reason
from flowlock.integrations.vllm_omni.minimax_h3.sequence_parallel import ATTRIBUTE as SP_ATTRIBUTE
from flowlock.integrations.vllm_omni.minimax_h3.sequence_parallel import SP_PLAN_MODULES
from flowlock.integrations.vllm_omni.minimax_h3.tensor_parallel import ATTRIBUTE as TP_ATTRIBUTE
from flowlock.models.common.run_context import RunDecisions

# Backends whose result is exact softmax attention (up to their own rounding): the strict path
# computes that with flowlock's attention instead.
DENSE_BACKENDS = frozenset({"FLASH_ATTN", "FLASH_ATTN_HUB", "FLASH_ATTN_3_HUB", "CUDNN_ATTN", "SDPA",
                            "FLASHINFER_ATTN"})


def linear_reason(module: nn.Module, biased: bool, lora: bool = False, tp_size: int = 1) -> str | None:
    """Why the strict path cannot compute this linear, or None; ``lora``: a LoRA wrapper is served here;
    ``tp_size``: the degree install() set up."""
    if is_lora_layer(module):
        if not lora:
            return (f"{type(module).__name__}: LoRA on this layer is not on the strict path (served: q/k/v, out, "
                    "fc1, fc2 of the blocks)")
        return lora_reason(module) or linear_reason(module.base_layer, biased, tp_size=tp_size)
    if type(module) not in LINEAR_CLASSES:
        return f"{type(module).__name__} is not one of vLLM's parallel linears"
    if type(module.quant_method) is not UnquantizedLinearMethod:
        return f"quantized ({type(module.quant_method).__name__})"
    if module.tp_size != tp_size:
        return f"tensor parallel size {module.tp_size} (install() set up the strict path for TP = {tp_size})"
    if module.skip_bias_add:
        return "skip_bias_add returns the bias unapplied; H3 never asks for that"
    if (module.bias is not None) != biased:
        return "has a bias where H3 has none" if biased is False else "has no bias where H3 has one"
    return None


def _rms_norm_reason(module: nn.Module) -> str | None:
    if type(module) is not RMSNorm or module.weight is None:
        return f"{type(module).__name__} is not vLLM-Omni's RMSNorm with a weight"
    return None


def hook_reason(module: nn.Module) -> str | None:
    registry = getattr(module, "_hook_registry", None)
    hooks = sorted(getattr(registry, "_hooks", {}) or {})
    return f"vLLM-Omni hooks {hooks} are installed" if hooks else None


class NativeRun(RunDecisions):
    """One vLLM-Omni H3 forward's decisions (:class:`~flowlock.models.common.run_context.RunDecisions`)
    and the TP / Ulysses operations install() set up on its root."""

    scope = "vllm_omni minimax_h3"
    root_name = "<root>"

    def __init__(self, check_indices: bool, root: nn.Module):
        super().__init__(check_indices, root)
        # TP > 1 operations install() set up on this module (None at TP = 1: no TP code runs)
        self.tp = getattr(root, TP_ATTRIBUTE, None)
        self.tp_size = 1 if self.tp is None else self.tp.degree
        # likewise Ulysses; ``sequence`` is the root forward's row shards once it has split the rows
        self.sp = getattr(root, SP_ATTRIBUTE, None)
        self.sp_degree = 1 if self.sp is None else self.sp.degree
        self.sequence = None

    @classmethod
    def for_model(cls, model: nn.Module) -> NativeRun:
        run = cls(check_indices=False, root=model)
        run._check(model, run._model_reason(model))
        if run.runs_own(model):
            return run
        for name in ("video_patch_proj", "audio_patch_proj", "condition_proj"):
            module = getattr(model, name)
            run._check(module, linear_reason(module, biased=True, tp_size=run.tp_size))
        run._check_time_embedder(model.time_embedder)
        run._check_refiner(model.token_refiner)
        for block in model.blocks:
            run._check_block(block)
        run._check_final_layer(model.final_layer)
        return run

    @classmethod
    def for_module(cls, module: nn.Module) -> NativeRun:
        """Decisions for one patched submodule called outside a strict root forward."""
        run = cls(check_indices=True, root=module)
        checks = {MiniMaxH3DiTBlock: run._check_block, MiniMaxH3TokenRefinerBlock: run._check_refiner_block,
                  MiniMaxH3TokenRefiner: run._check_refiner, MiniMaxH3TimeEmbedder: run._check_time_embedder,
                  MiniMaxH3FinalLayer: run._check_final_layer}
        check = checks.get(type(module))
        if check is not None:
            check(module)
        else:
            run._check(module, linear_reason(module, biased=module.bias is not None, tp_size=run.tp_size))
        return run

    def _model_reason(self, model: nn.Module) -> str | None:
        if getattr(model, "_is_cached", False):
            return "Cache-DiT is enabled (it reuses or skips block outputs)"
        config = model.parallel_config
        served = {"ulysses_degree": self.sp_degree, "ring_degree": 1}
        for degree, serves in served.items():
            if int(getattr(config, degree, 1) or 1) != serves:
                return (f"sequence parallelism ({degree} {getattr(config, degree)}; install() set up the strict "
                        f"path for {serves})")
        if model.vsa_gates_enabled:
            return "VSA gates are enabled (sparse attention)"
        for name, module in model.named_modules():
            if self.sp is not None and name in SP_PLAN_MODULES:
                continue  # vLLM-Omni's SP split / gather hooks: the strict forward never calls these modules
            reason = hook_reason(module)
            if reason is not None:
                return f"{reason} on {name or '<root>'}"
        return None

    def _check_time_embedder(self, embedder: nn.Module) -> None:
        width = embedder.frequency_embedding_size
        if width < 2 or width % 2:
            # the diffusers strict path's rule too (timestep_sinusoid: any even width; H3 builds 256)
            self._check(embedder, f"timestep_sinusoid serves an even sinusoid width >= 2, got {width}")
            return
        for module in (embedder.proj_in, embedder.proj_out):
            self._check(module, linear_reason(module, biased=True, tp_size=self.tp_size), fallback=embedder)

    def _check_refiner(self, refiner: nn.Module) -> None:
        for block in refiner.blocks:
            self._check_refiner_block(block)
        self._check(refiner.final_norm, _rms_norm_reason(refiner.final_norm))

    def _check_refiner_block(self, block: nn.Module) -> None:
        self._check_attention(block.attn)
        self._check_mlp(block.mlp)
        for norm in (block.norm1, block.norm2):
            self._check(norm, _rms_norm_reason(norm), fallback=block)

    def _check_block(self, block: nn.Module) -> None:
        self._check_refiner_block(block)
        # the AdaLN table and the fused norm-modulate ops read these weights directly
        proj = block.adaln_proj.linear
        self._check(proj, linear_reason(proj, biased=True, tp_size=self.tp_size), fallback=block)

    def _check_final_layer(self, final: nn.Module) -> None:
        self._check(final.norm, _rms_norm_reason(final.norm), fallback=final)
        for module in (final.adaln_proj.linear, final.video_out, final.audio_out):
            self._check(module, linear_reason(module, biased=True, tp_size=self.tp_size), fallback=final)

    def _check_attention(self, attn: nn.Module) -> None:
        layer = attn.attention
        backend = getattr(layer, "attn_backend", None)
        name = backend.get_name() if backend is not None else "a model-owned kernel"
        if type(attn) is not MiniMaxH3Attention:
            reason = f"{type(attn).__name__} is not MiniMaxH3Attention"
        elif name not in DENSE_BACKENDS:
            reason = f"attention backend {name} is not dense softmax attention"
        elif attn.to_gate_compress is not None or attn.vsa_sparsity is not None:
            reason = "VSA sparse attention is configured"
        elif getattr(layer, "use_ring", False):
            reason = "ring attention"
        elif getattr(layer, "_kv_cache_dtype", None) is not None:
            reason = f"KV quantization to {layer._kv_cache_dtype}"
        elif attn.num_heads != attn.num_kv_heads:
            reason = "grouped-query attention (H3 has none)"
        elif not math.isclose(attn.softmax_scale, attn.head_dim ** -0.5, rel_tol=1e-12):
            reason = f"softmax scale {attn.softmax_scale} is not 1/sqrt(head_dim)"
        else:
            reason = None
        self._check(attn, reason)
        if reason is None:
            for module in (attn.qkv_proj, attn.out_proj):
                self._check(module, linear_reason(module, biased=False, lora=True, tp_size=self.tp_size),
                            fallback=attn)
            for norm in (attn.q_norm, attn.k_norm):
                self._check(norm, _rms_norm_reason(norm), fallback=attn)

    def _check_mlp(self, mlp: nn.Module) -> None:
        if type(mlp) is not MiniMaxH3MLP:
            self._check(mlp, f"{type(mlp).__name__} is not MiniMaxH3MLP")
            return
        for module in (mlp.fc1, mlp.fc2):
            self._check(module, linear_reason(module, biased=False, lora=True, tp_size=self.tp_size), fallback=mlp)

