"""The H3 strict path's refusals of models and inputs it cannot run, made before any op launches.

* At patch time, :func:`plan_dtypes` refuses (TypeError naming the module, the tensor, its dtype and
  the one it needs) a model whose dtypes the strict path cannot run, as the ops' own checks would
  refuse them mid-forward, and records the dtypes it was planned with
  (:mod:`flowlock.patch_guard`). The rules, from the ops' validation:

  - every tensor it reads is float32, bfloat16 or float16 (the ops' dtypes);
  - ``time_embedder`` is float32 (``timestep_mlp``; diffusers keeps it so);
  - the trunk (``context_embedder``, the token refiner, every block but its AdaLN projection,
    ``norm_out``) has ``context_embedder``'s dtype: the text rows, and with them the packed rows,
    enter every norm and linear in that dtype, which their weights must share;
  - ``proj_out`` and ``audio_proj_out`` share one dtype: both heads take rows cast to ``proj_out``'s;
  - a linear's bias has its weight's dtype.

  ``proj_in`` / ``audio_proj_in`` (inputs cast to their dtype), each AdaLN projection (its table is
  float32 whatever its weights) and ``rope`` (positions meet ``inv_freq`` in float32) may each be any
  of the three, as in diffusers. An all-float16 model (``model.half()``) is refused at ``time_embedder``.

* At call time, :func:`check_model` compares the model with what it was planned with: a cast after
  ``flowlock.patch`` (``model.half()``, ``.to(torch.bfloat16)``, one block ``.float()``,
  ``proj_out.bfloat16()``, also ``model.float()``, which would run) is refused with a TypeError
  naming the module, the tensor, both dtypes and the remedy: ``remove()`` the patch and patch again,
  which runs the patch-time rules on the new dtypes. A cast is refused rather than re-planned because
  the dtypes are part of the policy: in RL the rollout and the trainer must compute with the same
  ones, so changing them is an explicit act (a new patch), never something a forward adopts
  silently. Not casts: storage that diffusers' layerwise casting upcasts to the planned dtype, peft
  adapters added after patching (their dtypes are the LoRA path's to check), FSDP2 shards (planned in
  the dtype its MixedPrecisionPolicy unshards them to).
  Devices are not planned (moving a patched model is supported); every planned tensor must be on the
  inputs' device unless a hook on its module or above it moves it there at the call (group offloading,
  accelerate's offload hooks), else a ValueError names it.

* Positions: :mod:`flowlock.models.minimax_h3.positions`, checked with the layout.
"""

from __future__ import annotations

import torch
from torch import nn

from flowlock.finite import check_finite_samples
from flowlock.models.common.diffusers_hooks import compute_dtype, hook_names
from flowlock.models.common.peft_lora import is_peft_lora
from flowlock.ops._validate import FLOAT_DTYPES
from flowlock.patch_guard import adopt, guard_of, record

_TRUNK = ("context_embedder.", "token_refiner.", "transformer_blocks.", "norm_out.")
_HEADS = ("proj_out.", "audio_proj_out.")


def _named_tensors(module: nn.Module, prefix: str = "", hooked: bool = False, fsdp_dtype: torch.dtype | None = None):
    """``(qualified name, module, tensor, hooked, dtype)`` for every parameter and buffer the strict path
    reads: names as if peft's ``base_layer`` were not there, adapters left out; ``hooked`` when a hook
    on the module or above it may move its weights before they are used; ``dtype`` the one the strict
    path computes with (:func:`_compute_dtype`)."""
    hooked = hooked or bool(hook_names(module))
    fsdp_dtype = _fsdp_param_dtype(module, fsdp_dtype)
    for registered, parameters in ((module._parameters, True), (module._buffers, False)):
        for key, t in registered.items():
            if t is not None:
                dtype = fsdp_dtype if parameters and fsdp_dtype is not None and t.is_floating_point() else None
                yield prefix + key, module, t, hooked, dtype or compute_dtype(module, t)
    lora = is_peft_lora(module)
    for name, child in module._modules.items():
        if child is None or (lora and name != "base_layer"):
            continue
        yield from _named_tensors(child, prefix if lora else f"{prefix}{name}.", hooked, fsdp_dtype)


def _fsdp_param_dtype(module: nn.Module, inherited: torch.dtype | None) -> torch.dtype | None:
    """The dtype FSDP2 unshards ``module``'s parameters to: its ``MixedPrecisionPolicy.param_dtype``
    when ``module`` is an FSDP2 unit (None: their own dtype), else its unit's, ``inherited``. fp32
    master parameters sharded with ``param_dtype=bf16`` are bf16 when the strict path reads them, and
    fp32 DTensors between calls: both are the planned bf16."""
    if not torch.distributed.is_available():
        return inherited
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        return inherited
    return module._get_fsdp_state()._mp_policy.param_dtype


def _planned(model: nn.Module) -> dict[str, torch.dtype]:
    return {name: dtype for name, _, _, _, dtype in _named_tensors(model)}


def _need(name: str, planned: dict[str, torch.dtype]) -> tuple[torch.dtype | None, str]:
    """The one dtype the tensor ``name`` must have given the others (None: any of FLOAT_DTYPES), and why."""
    if name.startswith("time_embedder."):
        return torch.float32, "timestep_mlp computes the timestep embedding in float32"
    if name.startswith(_HEADS) and "proj_out.weight" in planned:
        return planned["proj_out.weight"], "both output heads take the rows cast to proj_out's dtype"
    if name.startswith(_TRUNK) and ".adaln_proj." not in name and "context_embedder.weight" in planned:
        return planned["context_embedder.weight"], ("the text rows, and every block's rows after them, are in "
                                                   "context_embedder's dtype, which each norm and linear must share")
    if name.endswith(".bias") and name[:-4] + "weight" in planned:
        return planned[name[:-4] + "weight"], "a linear's bias must have its weight's dtype"
    return None, ""


def _split(name: str) -> tuple[str, str]:
    module, _, tensor = name.rpartition(".")
    return module or "<root>", tensor


def check_runnable(planned: dict[str, torch.dtype]) -> None:
    """TypeError for the first tensor whose dtype the strict path cannot run (the module docstring's rules)."""
    for name, dtype in planned.items():
        if not dtype.is_floating_point:
            continue
        need, why = _need(name, planned)
        if dtype not in FLOAT_DTYPES or (need is not None and dtype != need):
            module, tensor = _split(name)
            wanted = need if need in FLOAT_DTYPES else " / ".join(str(d) for d in FLOAT_DTYPES)
            raise TypeError(f"{module}: {tensor} is {dtype}, flowlock's strict H3 path needs {wanted} there "
                            f"({why or 'the dtypes of flowlock ops'}); flowlock.patch refuses a model it cannot "
                            "run (keep diffusers' float32 modules float32: load with torch_dtype instead of "
                            "casting the whole model)")


def plan_dtypes(model: nn.Module) -> None:
    """At patch time: refuse dtypes the strict path cannot run, then record them as the plan's."""
    planned = _planned(model)
    check_runnable(planned)
    record(model, planned)


def check_model(model: nn.Module, device: torch.device) -> None:
    """At call time, before any op: the model still has the dtypes it was patched with and sits on
    ``device`` (see the module docstring). Host-only and cheap when nothing changed; skipped while
    ``torch.compile`` traces (dynamo guards on the parameters' dtypes and recompiles after a cast)."""
    if torch.compiler.is_compiling():
        return
    if device.type != "cpu" and device.index is None:
        # torch.device("cuda") names the current device, which every tensor on it reports with its index
        device = torch.device(device.type, torch.get_device_module(device.type).current_device())
    guard = guard_of(model)
    if guard is None:
        # a deep copy of a patched model, patched by no handle: planned as it is at its first call
        planned = _planned(model)
        check_runnable(planned)
        guard = adopt(model, planned)
    if guard.unchanged(model, device):
        return
    cast, moved = [], []
    for name, _, t, hooked, dtype in _named_tensors(model):
        planned = guard.planned.get(name)
        if planned is not None and dtype != planned:
            cast.append((name, dtype, planned))
        if t.device != device and not hooked:
            moved.append((name, t.device))
    if cast:
        (module, tensor), (name, has, needs) = _split(cast[0][0]), cast[0]
        more = f" ({len(cast) - 1} more tensor{'s' if len(cast) > 2 else ''} changed too)" if len(cast) > 1 else ""
        raise TypeError(f"{module}: {tensor} is {has}, but this model was patched with {needs}{more}: a cast after "
                        "flowlock.patch is refused before any op runs; to run the new dtypes, remove() the patch "
                        "and call flowlock.patch(model) again, which checks that they can run")
    if moved:
        (module, tensor), (_, where) = _split(moved[0][0]), moved[0]
        raise ValueError(f"{module}: {tensor} is on {where}, the inputs on {device}: move the model to the inputs' "
                         "device (or let an offloading hook onload it) before calling it")
    guard.accept(model, device)


def check_call(model: nn.Module, hidden_states: torch.Tensor, audio_hidden_states: torch.Tensor,
               encoder_hidden_states: torch.Tensor) -> None:
    """The strict root forward's checks of the model and its latents, after ``validate_structure``."""
    check_model(model, hidden_states.device)
    check_finite_samples([("hidden_states", hidden_states), ("audio_hidden_states", audio_hidden_states),
                          ("encoder_hidden_states", encoder_hidden_states)])
