"""Strict LoRA on vLLM-Omni's MiniMax-H3: the trainer's peft LoRA synced to the rollout, same bits.

The trainer (diffusers + peft, strict under ``flowlock.patch``) computes a LoRA'd projection as
``linear(x, W) + linear(linear(x, A), B) * s`` with ``s = alpha / r`` per module. vLLM-Omni holds
the same adapter in its own layout (vllm-omni 0.30.0, ``vllm_omni/diffusion/lora``): q / k / v as
three slices of the fused ``qkv_proj`` wrapper, fc1 as two slices ``fc1_0`` (gate) / ``fc1_1``
(up) of the fused ``fc1`` wrapper with ``lora_A`` duplicated and the halves of ``lora_B`` swapped
(diffusers' SwiGLU rows are [value; gate], native rows [gate; up]), the scale folded into
``lora_B``, every factor zero-padded to the manager's rank bucket. Its stock forward adds the
expand GEMM into the base output with one ``addmm``, which rounds differently from peft.

* :func:`map_lora_update_to_engine` turns the trainer's LoRA state dict into that layout (the
  in-memory sync verl-omni does), validated against the engine model before anything is moved.
* :func:`install_lora_layout` binds the fc1 slice names to the fused layer's shards.
* :func:`add_lora_to_engine` registers and activates the mapped tensors with vLLM-Omni's own
  ``DiffusionLoRAManager``.
* :func:`lora_reason` / :func:`add_lora` serve a wrapper on the strict path: each active slice
  adds ``linear(linear(x, A), B_folded)`` to its base output with flowlock ``linear``, at the
  adapter's own rank rather than the zero-padded bucket (flowlock ``linear`` may choose its launch
  configuration by K, so the trainer's K = r is kept).

Choice on the scale: it is folded into ``lora_B`` here, per module (vLLM folds one global scale,
which is wrong when per-module ranks differ), and the engine is told ``alpha = r`` so it folds
nothing more. A folded ``B * s`` gives the trainer's ``linear(., B) * s`` bit for bit only when
``s`` is a power of two and ``B * s`` neither overflows nor loses bits to underflow; otherwise
strict mode refuses the sync, naming the module and the scale (audit records it and folds).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from flowlock.modes import fallback_or_raise
from flowlock.ops._validate import memoized_over
from flowlock.ops.linear import linear

# diffusers block-local target -> (native module of the block, the engine LoRA names it becomes)
TARGETS = {
    "attn.to_q": ("attn.qkv_proj", ("attn.to_q",)),
    "attn.to_k": ("attn.qkv_proj", ("attn.to_k",)),
    "attn.to_v": ("attn.qkv_proj", ("attn.to_v",)),
    "attn.to_out.0": ("attn.out_proj", ("attn.out_proj",)),
    "ff.net.0.proj": ("mlp.fc1", ("mlp.fc1_0", "mlp.fc1_1")),
    "ff.net.2": ("mlp.fc2", ("mlp.fc2",)),
}
# vLLM-Omni's manager binds a sub-name to a shard of a fused layer through ``stacked_params_mapping``.
FC1_LAYOUT = ((".mlp.fc1", ".mlp.fc1_0", 0), (".mlp.fc1", ".mlp.fc1_1", 1))
_NATIVE_BLOCKS = {"transformer_blocks": "blocks", "token_refiner.refiner_blocks": "token_refiner.blocks"}
_NAME = re.compile(r"(?:.*\.)?(?P<blocks>transformer_blocks|token_refiner\.refiner_blocks)\.(?P<index>\d+)\."
                   r"(?P<target>.+)\.lora_(?P<side>[AB])\.weight")


def _vllm_lora_classes():
    from vllm.lora.layers import BaseLayerWithLoRA
    from vllm_omni.diffusion.lora.layers import DiffusionBaseLinearLayerWithLoRA

    return BaseLayerWithLoRA, DiffusionBaseLinearLayerWithLoRA


def is_lora_layer(module: nn.Module) -> bool:
    """True for any vLLM LoRA layer wrapper (vLLM's own or vLLM-Omni's diffusion subclass)."""
    return isinstance(module, _vllm_lora_classes()[0])


def _pattern_value(patterns: Mapping, module: str, default):
    # peft's rule: a pattern key matches a module name that ends with it at a dot boundary
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _power_of_two(s: float) -> bool:
    return s > 0 and math.isfinite(s) and math.frexp(s)[0] == 0.5


def _parse(tensors: Mapping[str, torch.Tensor], model: nn.Module) -> dict[str, dict]:
    """Group the trainer's tensors by diffusers module, each checked against the engine layer it wraps."""
    modules: dict[str, dict] = {}
    for name, tensor in tensors.items():
        match = _NAME.fullmatch(name)
        target = match and match["target"]
        if target not in TARGETS:
            raise ValueError(f"LoRA tensor {name!r} wraps no layer of the vLLM-Omni H3: only lora_A / lora_B of "
                             f"{sorted(TARGETS)} in transformer_blocks.* and token_refiner.refiner_blocks.* sync")
        native_blocks = model.blocks if match["blocks"] == "transformer_blocks" else model.token_refiner.blocks
        index = int(match["index"])
        if index >= len(native_blocks):
            raise ValueError(f"LoRA tensor {name!r} wraps no layer: the vLLM-Omni model has "
                             f"{len(native_blocks)} {match['blocks']}")
        if not isinstance(tensor, torch.Tensor) or tensor.ndim != 2 or not tensor.is_floating_point():
            raise ValueError(f"LoRA tensor {name!r} must be a 2-D floating tensor")
        module = f"{match['blocks']}.{index}.{target}"
        entry = modules.setdefault(module, {"block": native_blocks[index], "target": target,
                                            "native": f"{_NATIVE_BLOCKS[match['blocks']]}.{index}"})
        if match["side"] in entry:
            raise ValueError(f"LoRA tensor {name!r} duplicates lora_{match['side']} of {module}")
        entry[match["side"]] = tensor
    for module, entry in modules.items():
        _check_shapes(module, entry)
    return modules


def _check_shapes(module: str, entry: dict) -> None:
    if "A" not in entry or "B" not in entry:
        raise ValueError(f"LoRA of {module} is incomplete: lora_{'B' if 'A' in entry else 'A'} is missing")
    a, b = entry["A"], entry["B"]
    layer = entry["block"].get_submodule(TARGETS[entry["target"]][0])
    layer = getattr(layer, "base_layer", layer)
    attn = entry["block"].attn
    # the trainer's whole widths: under TP the engine layer holds this rank's heads (vLLM slices the
    # factors itself when it loads them); output_size / input_size are vLLM's unsharded sizes
    heads = attn.total_num_heads * attn.head_dim
    out = {"attn.to_q": heads, "attn.to_k": heads, "attn.to_v": heads}.get(entry["target"], layer.output_size)
    if a.shape != (a.shape[0], layer.input_size) or b.shape != (out, a.shape[0]) or a.shape[0] < 1:
        raise ValueError(f"LoRA of {module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the "
                         f"engine layer (in {layer.input_size}, out {out}): want (r, {layer.input_size}) / ({out}, r)")
    if a.dtype != b.dtype:
        raise ValueError(f"LoRA of {module}: lora_A is {a.dtype}, lora_B {b.dtype}")


def map_lora_update_to_engine(tensors: Mapping[str, torch.Tensor], peft_config: Mapping, *, model: nn.Module,
                              component: str = "transformer") -> tuple[dict[str, torch.Tensor], dict]:
    """The trainer's peft LoRA state dict as vLLM-Omni LoRA tensors and the config to load them with.

    ``tensors``: ``{...transformer_blocks.{i}.<target>.lora_{A,B}.weight: tensor}`` (any prefix, as
    ``peft.get_peft_model_state_dict`` or verl-omni's FSDP gather name them), targets
    ``attn.to_q/to_k/to_v``, ``attn.to_out.0``, ``ff.net.0.proj``, ``ff.net.2`` of the DiT and refiner
    blocks; ``lora_A (r, in)``, ``lora_B (out, r)``, one floating dtype per module. ``peft_config``:
    peft's ``lora_alpha`` (and optional ``alpha_pattern``, ``use_rslora``); each module's rank is
    read from its tensors' shapes, its scale is ``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA).
    ``model``: the engine's ``MiniMaxH3DiTModel`` every tensor is checked against.

    Returns ``({component}.blocks.{i}.attn.to_q.lora_A.weight: ..., ...)`` with q / k / v named for
    their ``qkv_proj`` slices, ``attn.out_proj``, ``mlp.fc1_0`` / ``mlp.fc1_1`` (``lora_A`` shared,
    ``lora_B`` halves swapped then split) and ``mlp.fc2``, each module's scale folded into its
    ``lora_B`` (dtypes kept), and a peft config with ``r = lora_alpha`` = the largest rank, so vLLM
    folds nothing more. Load them after :func:`install_lora_layout` (fc1's slice names).

    Raises ValueError, before anything is mapped, for a tensor that wraps no engine layer (names
    it), an incomplete, duplicated or misshaped pair, DoRA or a LoRA bias. In strict mode raises
    ``StrictModeError`` when a module's folded scale cannot give the trainer's bits: a scale that
    is not a power of two, ``B * s`` overflowing or underflowing, factors in a dtype other than the
    base layer's (vLLM-Omni computes LoRA in the activations' dtype), or an all-zero last row of
    ``lora_A`` (the engine reads a module's rank from its last non-zero row).
    """
    if peft_config.get("use_dora") or peft_config.get("lora_bias"):
        raise ValueError("DoRA and LoRA biases are not served by vLLM-Omni's diffusion LoRA layers")
    if "lora_alpha" not in peft_config:
        raise ValueError("peft_config needs lora_alpha (the scale is alpha / r)")
    modules = _parse(tensors, model)
    if not modules:
        raise ValueError("no LoRA tensors to sync")
    mapped: dict[str, torch.Tensor] = {}
    for module, entry in modules.items():
        a, b = entry["A"], entry["B"]
        rank = a.shape[0]
        alpha = float(_pattern_value(peft_config.get("alpha_pattern"), module, peft_config["lora_alpha"]))
        scale = alpha / (math.sqrt(rank) if peft_config.get("use_rslora") else rank)
        folded = b * scale
        layer = entry["block"].get_submodule(TARGETS[entry["target"]][0])
        base_dtype = getattr(layer, "base_layer", layer).weight.dtype
        reason = None
        if not _power_of_two(scale):
            reason = f"scale alpha / r = {alpha:g} / {rank} = {scale!r} is not a power of two: folding it into lora_B"
            reason += " rounds B, so the rollout cannot give the trainer's bits"
        elif not (torch.isfinite(folded).all() and torch.equal(folded / scale, b)):
            reason = f"lora_B * {scale:g} overflows or underflows in {b.dtype}"
        elif a.dtype != base_dtype:
            reason = f"factors are {a.dtype}, the base layer {base_dtype}: vLLM-Omni computes LoRA in {base_dtype}"
        elif not bool(a[-1].ne(0).any()):
            reason = "the last row of lora_A is all zero: the engine would read a smaller rank"
        if reason is not None:
            fallback_or_raise(f"vllm_omni lora sync {module}", reason)
        names = TARGETS[entry["target"]][1]
        if entry["target"] == "ff.net.0.proj":
            value, gate = folded.chunk(2, dim=0)
            parts = (gate.contiguous(), value.contiguous())
        else:
            parts = (folded,)
        for sub, part in zip(names, parts):
            mapped[f"{component}.{entry['native']}.{sub}.lora_A.weight"] = a
            mapped[f"{component}.{entry['native']}.{sub}.lora_B.weight"] = part
    rank = max(entry["A"].shape[0] for entry in modules.values())
    targets = sorted({sub.rsplit(".", 1)[-1] for entry in modules.values() for sub in TARGETS[entry["target"]][1]})
    config = {"r": rank, "lora_alpha": rank, "target_modules": targets, "use_rslora": False, "use_dora": False}
    return mapped, config


def install_lora_layout(model: nn.Module) -> None:
    """Let vLLM-Omni's LoRA manager bind ``mlp.fc1_0`` / ``mlp.fc1_1`` to fc1's gate / up shards.

    vllm-omni 0.30.0 declares the q / k / v slices of ``qkv_proj`` only. Adds the two fc1 entries to
    the instance's ``stacked_params_mapping`` (kept entries first; idempotent). Call it before a
    ``DiffusionLoRAManager`` is built on the model: the manager reads the mapping once.
    """
    existing = tuple(getattr(model, "stacked_params_mapping", ()) or ())
    model.stacked_params_mapping = existing + tuple(e for e in FC1_LAYOUT if e not in existing)


class _InMemoryAdapters(nn.Module):
    """The pipeline a ``DiffusionLoRAManager`` is built on: it scans ``transformer`` for layers to wrap
    and loads each adapter it adds through ``_load_diffusion_lora_adapter``, here from ``pending``
    (the mapped tensors, their ``PEFTHelper`` and the staging device) rather than from a path."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.transformer = model
        self.pending = None

    def _load_diffusion_lora_adapter(self, *, lora_request, lora_path, dtype):
        from vllm.lora.lora_model import LoRAModel

        tensors, helper, staging = self.pending
        lora = LoRAModel.from_lora_tensors(lora_model_id=lora_request.lora_int_id, tensors=dict(tensors),
                                           peft_helper=helper, device=staging, dtype=dtype)
        return lora, helper


def add_lora_to_engine(model: nn.Module, tensors: Mapping[str, torch.Tensor], config: Mapping, *,
                       adapter_id: int = 1, dtype: torch.dtype | None = None, manager=None):
    """Register and activate mapped LoRA tensors on ``model`` with vLLM-Omni's ``DiffusionLoRAManager``.

    ``tensors`` / ``config``: :func:`map_lora_update_to_engine`'s output (names under
    ``transformer.``). The manager wraps the targeted layers of ``model`` in place (the strict path
    reads the wrappers at forward time, so this may follow or precede ``install``), loads the tensors
    from memory through its per-pipeline loader hook and binds every one (it raises if one binds to
    no layer). ``dtype`` is the manager's LoRA dtype; by default the dtype of the model's BF16-set layers
    (``condition_proj``: bf16, or float32 for a model cast to FP32), which the strict path needs the
    LoRA buffers in (those of the base weights they add to). Returns the manager (``set_active_adapter(None)``
    suspends the adapter; ``remove_adapter(adapter_id)`` drops it).

    ``manager``: one this function returned for ``model`` earlier, to replace its adapter with an
    update (a second manager on wrapped layers would bind nothing). An adapter registered under
    ``adapter_id`` is removed first: the manager skips loading an id it holds, which would keep
    serving the old factors. ``dtype`` is then the manager's own.
    """
    from vllm.lora.peft_helper import PEFTHelper
    from vllm_omni.diffusion.lora.manager import DiffusionLoRAManager
    from vllm_omni.lora.request import LoRARequest

    device = next(model.parameters()).device
    # the model's device with an explicit index: vLLM pins host memory for the literal "cpu",
    # which a host without an accelerator cannot do (and a CPU model never copies from)
    staging = f"{device.type}:{device.index or 0}"
    pending = (tensors, PEFTHelper.from_dict(dict(config)), staging)
    if manager is None:
        install_lora_layout(model)
        holder = _InMemoryAdapters(model)
        if dtype is None:
            dtype = model.condition_proj.weight.dtype
        manager = DiffusionLoRAManager(holder, device=device, dtype=dtype)
    elif not isinstance(manager.pipeline, _InMemoryAdapters) or manager.pipeline.transformer is not model:
        raise ValueError("manager was not built by add_lora_to_engine for this model")
    manager.remove_adapter(adapter_id)
    manager.pipeline.pending = pending
    request = LoRARequest(lora_name=f"flowlock-sync-{adapter_id}", lora_int_id=adapter_id,
                          lora_path=f"/flowlock/in-memory/{adapter_id}")
    try:
        manager.set_active_adapter(request, 1.0)
    finally:
        manager.pipeline.pending = None
    return manager


def lora_reason(module: nn.Module) -> str | None:
    """Why the strict path cannot compute this vLLM LoRA wrapper's adapter part, or None."""
    _, diffusion_cls = _vllm_lora_classes()
    if not isinstance(module, diffusion_cls):
        return f"{type(module).__name__} is vLLM's LoRA layer (punica kernels), not vLLM-Omni's diffusion LoRA layer"
    config = getattr(module, "lora_config", None)
    if config is not None and config.fully_sharded_loras:
        return "fully sharded LoRA"
    stacks = (*module.lora_a_stacked, *module.lora_b_stacked)
    if any(t.shape[0] != 1 or t.shape[1] != 1 for t in stacks):
        return "more than one LoRA slot"
    base = module.base_layer.weight
    if any(t.dtype != base.dtype or t.device != base.device for t in stacks):
        return f"LoRA buffers are not {base.dtype} on {base.device} like the base weight"
    if len(module.output_slices) != len(module.lora_a_stacked):
        return "LoRA slice metadata does not match the layer's output slices"
    return None


def _factors(stack_a: torch.Tensor, stack_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One slice's ``(A (r, in), B (out, r))`` without the zero padding to the rank bucket, or None
    when the slice holds no adapter; memoized while neither buffer is written."""

    def read():
        a, b = stack_a[0, 0], stack_b[0, 0]
        live = a.ne(0).any(dim=1).nonzero()
        if live.numel() == 0:
            return None
        # rows past the adapter's rank were zeroed by set_lora; the trainer's rank ends at its last
        # non-zero row of A (the sync refuses an adapter whose last row is zero in strict mode)
        rank = int(live[-1]) + 1
        return a[:rank], b[:, :rank].contiguous()

    return memoized_over([stack_a, stack_b], "vllm_omni_lora_factors", read)


def add_lora(module: nn.Module, x: torch.Tensor, outputs: list[torch.Tensor],
             a_stacks: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The base outputs of a vLLM linear, one per output slice, with its active LoRA slices added.

    ``x (T, in)``; ``outputs`` ``[(T, slice_i)]`` in the layer's slice order (q, k, v; gate, up; or
    one). For a LoRA wrapper (checked by :func:`lora_reason`), an active slice with an adapter gets
    ``outputs[i] + linear(linear(x, A_i), B_i)``: the trainer's ``base + linear(linear(x, A), B) * s``
    bits when ``B_i`` holds ``B * s`` for a power-of-two ``s`` (see :func:`map_lora_update_to_engine`).
    ``a_stacks``: the whole-K ``lora_A`` buffers of a K-sharded layer under tensor parallelism (its
    ranks' blocks, gathered), instead of the layer's own. A plain linear returns ``outputs`` unchanged.
    """
    if not is_lora_layer(module):
        return outputs
    a_stacks = module.lora_a_stacked if a_stacks is None else a_stacks
    # vLLM-Omni's own rule: no mask means every slice is active
    active = getattr(module, "_diffusion_lora_active_slices", None) or (True,) * len(outputs)
    result = list(outputs)
    for i, on in enumerate(active):
        factors = _factors(a_stacks[i], module.lora_b_stacked[i]) if on else None
        if factors is not None:
            a, b = factors
            result[i] = result[i] + linear(linear(x, a), b)
    return result
