"""The rollout side of verl-omni's H3 weight sync: the actor's weights and LoRA on vLLM-Omni's native DiT, bitwise.

verl-omni's actor (diffusers ``MiniMaxH3Transformer3DModel`` under FSDP2) sends its weights to the
vLLM-Omni rollout in buckets of ``(name, tensor)`` pairs, diffusers names under the pipeline
component ``transformer.``; with an unmerged LoRA it sends the adapter's factors and peft config
instead, and with ``lora.merge=True`` weights with the adapter merged in. Here:

* :func:`load_full_weights` writes one bucket into ``MiniMaxH3DiTModel`` (vllm-omni 0.30.0) through
  flowlock's H3 name table and layout transforms (:mod:`flowlock.checkpoint.minimax_h3`, what
  ``flowlock convert`` uses), copying bits; :class:`FullSync` collects the buckets of one sync and
  checks at :meth:`FullSync.finish` that every native parameter was written exactly once.
* :func:`map_lora_update` / :func:`add_lora` carry an unmerged peft LoRA to the rollout through
  :mod:`flowlock.integrations.vllm_omni.lora`, whose strict LoRA computes the actor's bits.
* :func:`merged_weights` is the actor's merged weights under one fixed arithmetic (see there).

Every refusal happens before anything is written and names what it refuses. vLLM and vLLM-Omni are
imported only inside the LoRA functions.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Iterator, Mapping

import torch
from torch import nn

from flowlock.checkpoint.errors import CheckpointError
from flowlock.checkpoint.finite import nonfinite_count
from flowlock.checkpoint.minimax_h3.geometry import H3Geometry
from flowlock.checkpoint.minimax_h3.names import Entry, name_table
from flowlock.checkpoint.minimax_h3.plan import Plan, convert_entry
from flowlock.integrations.vllm_omni.lora import TARGETS, add_lora_to_engine, map_lora_update_to_engine
from flowlock.models.common.peft_lora import is_peft_lora
from flowlock.ops.linear import linear

# The pipeline component verl-omni prefixes the actor's transformer weights with.
COMPONENT = "transformer."
# MiniMaxH3DiTModel holds q / k / v stacked in memory ([Q; K; V]: vLLM's QKV loader packs them so).
_IN_MEMORY_QKV = "stacked"
# peft names a LoRA layer's own linear ``<module>.base_layer``, vLLM its LoRA wrapper's the same way.
_BASE_LAYER = re.compile(r"\.base_layer(?=\.(?:weight|bias)$)")
_LISTED = 8  # names shown per finding


def _shown(names: Iterable[str]) -> str:
    names = sorted(names)
    more = f", ... and {len(names) - _LISTED} more" if len(names) > _LISTED else ""
    return f"{len(names)}: {', '.join(names[:_LISTED])}{more}"


def native_geometry(native_dit: nn.Module) -> H3Geometry:
    """The H3 geometry of a vLLM-Omni ``MiniMaxH3DiTModel`` (its ``arch`` and its RoPE theta)."""
    return H3Geometry.from_config({**dataclasses.asdict(native_dit.arch), "rope_theta": native_dit._rope_theta})


def _exact_cast_problem(tensor: torch.Tensor, dtype: torch.dtype) -> str | None:
    """Why ``tensor`` (finite, floating) does not convert to ``dtype`` exactly, or None."""
    if tensor.dtype == dtype:
        return None
    # float64 holds every bf16 / fp16 / fp32 value exactly, so the comparison is of the values themselves
    changed = int(tensor.to(dtype).double().ne(tensor.double()).sum())
    if changed:
        return f"{tensor.dtype} -> {dtype} rounds {changed} of {tensor.numel()} elements"
    return None


class _NativeTarget:
    """A native H3 DiT as the destination of diffusers-named tensors: where each one's rows go."""

    def __init__(self, native_dit: nn.Module, prefix: str):
        self.model = native_dit
        self.prefix = prefix
        geometry = native_geometry(native_dit)
        self.plan = Plan("native", geometry, _IN_MEMORY_QKV, name_table(geometry))
        # diffusers name -> (its entry, its position among the entry's sources)
        self.sources = {name: (entry, j) for entry in self.plan.entries for j, name in enumerate(entry.diffusers)}
        # vLLM's LoRA wrappers hold the base weight under ``.base_layer``: the same parameter
        self.params = {_BASE_LAYER.sub("", name): p for name, p in native_dit.named_parameters()}
        self._rows: dict[str, list[torch.Tensor | None]] = {}
        self._check_layout()

    def _check_layout(self) -> None:
        tp = max((getattr(m, "tp_size", 1) for m in self.model.modules()), default=1)
        if tp > 1:
            raise CheckpointError(f"the native model is tensor-parallel (tp_size {tp}): the full-weight sync maps "
                                  "whole tensors only (flowlock's H3 mapper has no TP shard layout)")
        expected = {e.native: e.native_shape for e in self.plan.entries if e.kind != "rope"}
        extra, lacking = set(self.params) - set(expected), set(expected) - set(self.params)
        problems = [f"parameters outside the table {_shown(extra)}"] if extra else []
        problems += [f"table tensors the model lacks {_shown(lacking)}"] if lacking else []
        problems += [f"{name}: shape {list(self.params[name].shape)}, the table gives {list(shape)}"
                     for name, shape in expected.items() if name in self.params and self.params[name].shape != shape]
        if problems:
            raise CheckpointError("the native model does not hold the whole H3 tensors of its own geometry", problems)

    def rows(self, entry: Entry) -> list[torch.Tensor | None]:
        """Per source of ``entry``: the native rows its rows go to, in order (None: the whole tensor).

        Derived by pushing row ids through the mapper's own transform (:func:`convert_entry`), so
        the placement is by construction the one ``flowlock convert`` writes."""
        if entry.kind == "rename":
            return [None]
        if entry.native not in self._rows:
            sizes = [shape[0] for shape in entry.diffusers_shapes]
            starts = [sum(sizes[:j]) for j in range(len(sizes))]
            ids = {name: torch.arange(start, start + n).unsqueeze(1)
                   for name, start, n in zip(entry.diffusers, starts, sizes)}
            placed = convert_entry(self.plan, entry, ids.__getitem__)[entry.native][:, 0]  # native row -> source row
            self._rows[entry.native] = list(torch.argsort(placed).split(sizes))
        return self._rows[entry.native]

    def check(self, weights: Iterable[tuple[str, torch.Tensor]], written: set[str]
              ) -> list[tuple[str, Entry, int, torch.Tensor]]:
        """Every pair of one bucket resolved to ``(diffusers name, entry, source index, tensor)``.

        Raises :class:`CheckpointError` listing every problem; nothing is written here."""
        items, seen, problems = [], set(), []
        for sent, tensor in weights:
            name = _BASE_LAYER.sub("", sent[len(self.prefix):]) if sent.startswith(self.prefix) else None
            if name is None:
                problems.append(f"{sent}: not under {self.prefix!r}, the component this sync writes")
            elif ".lora_" in name:
                problems.append(f"{sent}: a LoRA factor; an unmerged adapter syncs through add_lora, a merged "
                                "one as merged_weights")
            elif name not in self.sources:
                problems.append(f"{sent}: no such tensor in the H3 name table")
            elif name in seen or name in written:
                problems.append(f"{sent}: written twice in one sync")
            else:
                seen.add(name)
                entry, j = self.sources[name]
                problem = self._tensor_problem(tensor, entry.diffusers_shapes[j], self.params[entry.native].dtype)
                if problem:
                    problems.append(f"{sent}: {problem}")
                else:
                    items.append((name, entry, j, tensor))
        if problems:
            raise CheckpointError("refusing this weight bucket; nothing of it was written", problems)
        return items

    @staticmethod
    def _tensor_problem(tensor: object, shape: tuple[int, ...], dtype: torch.dtype) -> str | None:
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            return f"{type(tensor).__name__} {getattr(tensor, 'dtype', '')}, want a floating tensor"
        if tuple(tensor.shape) != shape:
            return f"shape {list(tensor.shape)}, the table gives {list(shape)}"
        bad = nonfinite_count(tensor)
        if bad:
            return f"{bad} of {tensor.numel()} elements are not finite"
        return _exact_cast_problem(tensor, dtype)

    @torch.no_grad()
    def write(self, items: list[tuple[str, Entry, int, torch.Tensor]]) -> set[str]:
        """Copy checked items into the model's parameters; the native names written."""
        for _, entry, j, tensor in items:
            param = self.params[entry.native]
            source = tensor.to(device=param.device, dtype=param.dtype)
            rows = self.rows(entry)[j]
            if rows is None:
                param.copy_(source)
            else:
                param.index_copy_(0, rows.to(param.device), source)
        # Memos keyed on the weights (flowlock's, vLLM-Omni's AdaLN cache) see the in-place writes bump the
        # parameters' version counters; the AdaLN cache's old tables would only hold memory, so they are
        # dropped, as vLLM-Omni's own loader drops them
        cache = getattr(self.model, "adaln_cache", None)
        if cache is not None:
            cache.clear()
        return {entry.native for _, entry, _, _ in items}


def load_full_weights(native_dit: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], *,
                      prefix: str = COMPONENT) -> set[str]:
    """Write one bucket of the actor's full weights into vLLM-Omni's ``MiniMaxH3DiTModel``, bit for bit.

    ``weights``: ``(prefix + diffusers name, tensor)`` pairs of ``MiniMaxH3Transformer3DModel``, any
    subset of its tensors (peft's ``.base_layer`` spelling of a LoRA layer's weight is the same
    tensor), each of its diffusers shape. Each goes where flowlock's H3 name table puts it: renamed
    tensors whole, ``attn.to_q`` / ``to_k`` / ``to_v`` into their rows of the stacked ``qkv_proj``,
    the two halves of ``ff.net.0.proj`` swapped into ``mlp.fc1``. Values are copied, cast only to a
    dtype that holds them exactly (a widening cast), so the native parameters hold the actor's bits.

    Raises :class:`~flowlock.checkpoint.CheckpointError` before writing anything of the bucket for a
    name outside ``prefix`` or the table (LoRA factors included), one named twice, a tensor that is
    not floating, of another shape, holding NaN or Inf, or whose cast to the parameter's dtype would
    round; and before looking at the bucket for a native model that is tensor-parallel or does not
    hold H3's whole tensors of its own geometry. Returns the native parameter names written (names
    of ``native_dit``, without ``prefix``).
    """
    target = _NativeTarget(native_dit, prefix)
    return target.write(target.check(weights, set()))


class FullSync:
    """One complete full-weight sync of ``native_dit``: the buckets, then :meth:`finish`.

    ``sync = FullSync(native_dit); sync.load(bucket) ...; sync.finish()``. Each bucket is checked and
    written as by :func:`load_full_weights`; a tensor already written by an earlier bucket of this
    sync refuses the whole bucket. ``finish`` refuses a sync that missed any tensor of the actor.
    """

    def __init__(self, native_dit: nn.Module, *, prefix: str = COMPONENT):
        self._target = _NativeTarget(native_dit, prefix)
        self._written: set[str] = set()
        self._finished = False

    @property
    def complete(self) -> bool:
        """Whether every actor tensor has been written (then :meth:`finish` succeeds)."""
        return set(self._target.sources) <= self._written

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Write one bucket; returns the native parameter names it wrote."""
        if self._finished:
            raise RuntimeError("this sync is finished; start a new FullSync")
        items = self._target.check(weights, self._written)
        written = self._target.write(items)
        self._written.update(name for name, _, _, _ in items)
        return written

    def finish(self) -> set[str]:
        """End the sync: every native parameter must have been written exactly once.

        Raises :class:`~flowlock.checkpoint.CheckpointError` naming the actor tensors no bucket
        carried. Then writes the native ``rope.inv_freq`` buffer, which diffusers does not store, as
        the mapper computes it from the geometry (a model built with dummy weights holds garbage
        there). Returns every native name of the model (parameters and ``rope.inv_freq``).
        """
        missing = set(self._target.sources) - self._written
        if missing:
            raise CheckpointError("the sync missed actor tensors, so native parameters keep old values",
                                  [f"never sent {_shown(missing)}"])
        self._finished = True
        rope = next(e for e in self._target.plan.entries if e.kind == "rope")
        with torch.no_grad():
            buffer = self._target.model.get_buffer(rope.native)
            # the rope entry is computed from the geometry: nothing is loaded
            buffer.copy_(convert_entry(self._target.plan, rope, None)[rope.native])
        return set(self._target.params) | {rope.native}



class RolloutSyncs:
    """The full-weight syncs of one rollout DiT as verl-omni delivers them: buckets of a whole
    pipeline's tensors and no call that ends a sync.

    :meth:`load` writes a bucket's transformer tensors through a :class:`FullSync` and finishes it
    once every actor tensor has arrived, so the next bucket starts the next sync; a sync that ended
    short is refused by the next one (its first tensor arrives twice in one sync). LoRA factors
    (``lora_A`` / ``lora_B``) are skipped: they reach the rollout through :func:`add_lora`.
    """

    def __init__(self, native_dit: nn.Module, *, prefix: str = COMPONENT):
        self._model, self._prefix = native_dit, prefix
        self._sync: FullSync | None = None

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]
             ) -> tuple[set[str], list[tuple[str, torch.Tensor]]]:
        """Returns the native names written (with the prefix) and the bucket's other components'
        tensors, untouched, for their own loader."""
        mine, others = [], []
        for name, tensor in weights:
            if not name.startswith(self._prefix):
                others.append((name, tensor))
            elif ".lora_A." not in name and ".lora_B." not in name:
                mine.append((name, tensor))
        if not mine:
            return set(), others
        sync = self._sync or FullSync(self._model, prefix=self._prefix)
        written = sync.load(mine)
        if sync.complete:
            written |= sync.finish()
            sync = None
        self._sync = sync
        return {self._prefix + name for name in written}, others


def _peft_targets(config: Mapping, modules: Iterable[str]) -> set[str]:
    """The modules peft's ``target_modules`` rule picks among ``modules`` (a string is a full-match
    regex, a collection matches a name or a dot-bounded suffix), less ``exclude_modules``."""

    def picked(patterns) -> set[str]:
        if not patterns:
            return set()
        if isinstance(patterns, str):
            return {m for m in modules if re.fullmatch(patterns, m)}
        return {m for m in modules if any(m == p or m.endswith(f".{p}") for p in patterns)}

    return picked(config.get("target_modules")) - picked(config.get("exclude_modules"))


def lora_config_problems(peft_config: Mapping, geometry: H3Geometry) -> list[str]:
    """Why the rollout cannot compute a LoRA of this peft config with the actor's bits (empty: it can).

    Looked at: ``target_modules`` (explicit, matching only the LoRA targets vLLM-Omni's H3 wraps:
    ``attn.to_q/to_k/to_v``, ``attn.to_out.0``, ``ff.net.0.proj``, ``ff.net.2`` of the DiT and refiner
    blocks), ``lora_dropout`` (must be 0: the actor's LoRA forward would be random), ``use_dora``,
    ``modules_to_save`` and ``target_parameters`` (fully trained modules and parameter LoRA the
    adapter's factors do not carry). Rank, alpha, rsLoRA and LoRA bias are checked per module by
    :func:`~flowlock.integrations.vllm_omni.lora.map_lora_update_to_engine`.
    """
    problems = []
    targets = peft_config.get("target_modules")
    if not targets or targets == "all-linear":
        problems.append(f"target_modules is {targets!r}: name the LoRA targets explicitly")
    else:
        modules = {name.rsplit(".", 1)[0] for entry in name_table(geometry) for name in entry.diffusers}
        supported = re.compile(r"(?:transformer_blocks|token_refiner\.refiner_blocks)\.\d+\.(?:"
                               + "|".join(map(re.escape, TARGETS)) + ")")
        picked = _peft_targets(peft_config, modules)
        outside = {m for m in picked if not supported.fullmatch(m)}
        if not picked:
            problems.append(f"target_modules {targets!r} match no H3 module")
        if outside:
            problems.append(f"target_modules {targets!r} reach modules the rollout's LoRA layers do not wrap "
                            f"{_shown(outside)}")
    if float(peft_config.get("lora_dropout") or 0.0) > 0.0:
        problems.append(f"lora_dropout = {peft_config['lora_dropout']}: the actor's LoRA forward draws a dropout "
                        "mask the rollout cannot reproduce")
    for key, why in (("use_dora", "DoRA is not computed by vLLM-Omni's diffusion LoRA layers"),
                     ("modules_to_save", "those modules train in full; the adapter's factors do not carry them"),
                     ("target_parameters", "parameter LoRA is not served by vLLM-Omni's diffusion LoRA layers")):
        if peft_config.get(key):
            problems.append(f"{key} = {peft_config[key]!r}: {why}")
    return problems


def _config_dict(peft_config) -> dict:
    return dict(peft_config.to_dict() if hasattr(peft_config, "to_dict") else peft_config)


def map_lora_update(native_dit: nn.Module, tensors: Mapping[str, torch.Tensor], peft_config
                    ) -> tuple[dict[str, torch.Tensor], dict]:
    """The actor's LoRA update as vLLM-Omni LoRA tensors and config: what a rollout pipeline's
    ``map_lora_update_to_engine(tensors, peft_config)`` hook (which vLLM-Omni's LoRA manager calls
    while loading a tensor adapter) should return for ``native_dit``.

    ``tensors``: peft's LoRA state dict of the actor's transformer (``lora_A (r, in)`` /
    ``lora_B (out, r)`` per module, any prefix); ``peft_config``: a peft ``LoraConfig`` or its dict.
    Raises ValueError naming every reason of :func:`lora_config_problems`, then whatever
    :func:`~flowlock.integrations.vllm_omni.lora.map_lora_update_to_engine` refuses (a tensor that
    wraps no layer, a broken pair, DoRA, a LoRA bias; in strict mode ``StrictModeError`` for a scale
    that is not a power of two, a fold that overflows, factors in another dtype than the base).
    """
    config = _config_dict(peft_config)
    problems = lora_config_problems(config, native_geometry(native_dit))
    if problems:
        raise ValueError("refusing this LoRA: the rollout cannot compute it with the actor's bits\n  - "
                         + "\n  - ".join(problems))
    return map_lora_update_to_engine(tensors, config, model=native_dit)


def add_lora(native_dit: nn.Module, tensors: Mapping[str, torch.Tensor], peft_config, *, manager=None,
             adapter_id: int = 1):
    """Map the actor's LoRA update (:func:`map_lora_update`) and activate it on ``native_dit`` with
    vLLM-Omni's ``DiffusionLoRAManager``, in this process.

    The rollout's strict forward (``flowlock.integrations.vllm_omni.install``) then adds each module's
    LoRA as ``linear(linear(x, A), B * s)``: the bits of the actor's peft LoRA under
    ``flowlock.patch``. ``manager``: the one a previous call returned, for an update (it replaces the
    adapter). Returns the manager. Refuses as :func:`map_lora_update`, before any layer is wrapped.
    """
    mapped, config = map_lora_update(native_dit, tensors, peft_config)
    return add_lora_to_engine(native_dit, mapped, config, adapter_id=adapter_id, manager=manager)



def merge_lora_weight(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float
                      ) -> torch.Tensor:
    """``W + (B @ A) * scale`` for ``W (out, in)``, ``A (r, in)``, ``B (out, r)``, in ``W``'s dtype.

    The arithmetic, fixed: ``B @ A`` by flowlock ``linear`` with an FP32 result (each element from
    its row of ``B`` and column of ``A`` in one fixed K order: the same bits whatever else is
    computed; on CPU, float64 accumulation rounded once to FP32); times ``scale`` rounded to FP32;
    plus ``W`` in FP32; rounded once to ``W``'s dtype. peft's own merge rounds ``B @ A`` and the
    scaled delta to the weight's dtype first, in an order that depends on the device.
    """
    lora_at = lora_a.t().contiguous()
    delta = linear(lora_b.contiguous(), lora_at, out_dtype=torch.float32)
    delta = delta * torch.tensor(scale, dtype=torch.float32, device=delta.device)
    return (weight.float() + delta).to(weight.dtype)


def _merge_problem(module: nn.Module) -> str | None:
    if module.merged:
        return "peft merged it already (its own arithmetic, not merge_lora_weight's)"
    active = [a for a in module.active_adapters if a in module.lora_A]
    if len(active) != 1:
        return f"{len(active)} active adapters; one is merged"
    name = active[0]
    if name in getattr(module, "lora_variant", {}) or getattr(module, "use_dora", {}).get(name):
        return f"adapter {name!r} is a LoRA variant (DoRA or other)"
    a, b = module.lora_A[name], module.lora_B[name]
    if a.bias is not None or b.bias is not None:
        return f"adapter {name!r} has a LoRA bias"
    if a.weight.dtype != b.weight.dtype:
        return f"adapter {name!r}: lora_A is {a.weight.dtype}, lora_B {b.weight.dtype}"
    if getattr(module, "fan_in_fan_out", False):
        return "fan_in_fan_out weights"
    if not math.isfinite(module.scaling[name]):
        return f"scale {module.scaling[name]} is not finite"
    return None


def merged_weights(peft_model: nn.Module, *, prefix: str = COMPONENT) -> Iterator[tuple[str, torch.Tensor]]:
    """The actor's full weights with its LoRA merged, as ``(prefix + diffusers name, tensor)`` pairs.

    ``peft_model``: the diffusers H3 with one active peft LoRA adapter (``add_adapter``, or a
    ``PeftModel`` around it), unmerged. Every LoRA layer's weight is :func:`merge_lora_weight` of its
    base weight and the active adapter; every other tensor is the model's own (no LoRA factors, no
    ``.base_layer`` spelling). Feed them to :func:`load_full_weights` / :class:`FullSync`: the rollout
    then holds these bits, which are the actor's only where the actor computes with the same merged
    weights (an unmerged LoRA forward, ``x W^T + (x A^T) B^T s``, rounds differently).

    Raises ValueError, before yielding anything, naming every LoRA layer that cannot be merged so: one
    peft merged already, more or fewer than one active adapter, a LoRA variant (DoRA), a LoRA bias,
    ``fan_in_fan_out``.
    """
    layers = {name: m for name, m in peft_model.named_modules() if is_peft_lora(m)}
    problems = [f"{name}: {p}" for name, m in layers.items() if (p := _merge_problem(m))]
    if problems:
        raise ValueError("refusing to merge this LoRA\n  - " + "\n  - ".join(problems))
    return _merged(peft_model, layers, prefix)


def _merged(peft_model: nn.Module, layers: Mapping[str, nn.Module], prefix: str
            ) -> Iterator[tuple[str, torch.Tensor]]:
    with torch.no_grad():
        for name, tensor in peft_model.state_dict().items():
            if ".lora_" in name:
                continue
            module, _, kind = _BASE_LAYER.sub("", name).rpartition(".")
            layer = layers.get(module)
            if layer is not None and kind == "weight":
                adapter = next(a for a in layer.active_adapters if a in layer.lora_A)
                tensor = merge_lora_weight(tensor, layer.lora_A[adapter].weight, layer.lora_B[adapter].weight,
                                           layer.scaling[adapter])
            yield prefix + _peft_wrapper_free(f"{module}.{kind}"), tensor


def _peft_wrapper_free(name: str) -> str:
    # a PeftModel wraps the transformer as base_model.model
    return name.removeprefix("base_model.model.")
