"""A per-sample trajectory artifact: what one sample saw at every transition, content-hashed.

A :class:`Trajectory` holds the sample's seed and id, run-level tensors (the sigma grids, the
initial latents) and, per transition, named tensors (latents, velocities, log-probs, ...). Every
tensor's hash is sha256 over its dtype, its shape and its raw bytes, so two artifacts agree on a
tensor exactly when the bits agree. ``save`` writes ``<path>`` (safetensors) and
``<path>.json`` (metadata and hashes); ``load`` verifies every hash. :func:`compare` names the
first place two trajectories diverge, which is where a rollout/replay drift starts.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FORMAT = "flowlock.trajectory/1"


def tensor_hash(t: torch.Tensor) -> str:
    """sha256 hex digest of ``dtype``, ``shape`` and the raw bytes of ``t`` (row-major, on CPU)."""
    cpu = t.detach().to("cpu").contiguous()
    h = hashlib.sha256()
    h.update(str(cpu.dtype).encode())
    h.update(repr(tuple(cpu.shape)).encode())
    h.update(cpu.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not name or "/" in name or name.startswith("step"):
        raise ValueError(f"tensor names must be non-empty strings without '/' not starting with 'step', got {name!r}")
    return name


@dataclass
class Trajectory:
    """One sample's trajectory. ``run`` maps names to run-level tensors; ``steps[k]`` maps names to
    the tensors of transition ``k``. Tensors are stored detached on the CPU."""

    seed: int
    sample_id: int
    run: dict[str, torch.Tensor] = field(default_factory=dict)
    steps: list[dict[str, torch.Tensor]] = field(default_factory=list)

    def set_run(self, name: str, tensor: torch.Tensor) -> None:
        self.run[_check_name(name)] = tensor.detach().to("cpu").clone()

    def record(self, step: int, name: str, tensor: torch.Tensor) -> None:
        """Store ``tensor`` under ``name`` for transition ``step`` (steps are added in order)."""
        if step < 0 or step > len(self.steps):
            raise ValueError(f"step {step} out of order: {len(self.steps)} steps recorded")
        if step == len(self.steps):
            self.steps.append({})
        self.steps[step][_check_name(name)] = tensor.detach().to("cpu").clone()

    def hashes(self) -> dict[str, str]:
        """``{"run/<name>" | "step<k>/<name>": sha256}`` for every stored tensor."""
        out = {f"run/{n}": tensor_hash(t) for n, t in self.run.items()}
        for k, tensors in enumerate(self.steps):
            out.update({f"step{k}/{n}": tensor_hash(t) for n, t in tensors.items()})
        return out

    def save(self, path: str | Path) -> None:
        """Write ``path`` (safetensors) and ``path + ".json"`` (seed, id, step names, hashes)."""
        path = Path(path)
        flat = {f"run/{n}": t.contiguous() for n, t in self.run.items()}
        for k, tensors in enumerate(self.steps):
            flat.update({f"step{k}/{n}": t.contiguous() for n, t in tensors.items()})
        save_file(flat, str(path))
        meta = {"format": FORMAT, "seed": self.seed, "sample_id": self.sample_id,
                "run": sorted(self.run), "steps": [sorted(t) for t in self.steps], "hashes": self.hashes()}
        Path(str(path) + ".json").write_text(json.dumps(meta, indent=1, sort_keys=True))

    @classmethod
    def load(cls, path: str | Path) -> Trajectory:
        """Read an artifact written by :meth:`save`; ``ValueError`` if any tensor's hash disagrees."""
        path = Path(path)
        meta = json.loads(Path(str(path) + ".json").read_text())
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path}: not a {FORMAT} artifact")
        flat = load_file(str(path))
        traj = cls(int(meta["seed"]), int(meta["sample_id"]))
        for name in meta["run"]:
            traj.run[name] = flat[f"run/{name}"]
        for k, names in enumerate(meta["steps"]):
            traj.steps.append({n: flat[f"step{k}/{n}"] for n in names})
        actual = traj.hashes()
        if actual != meta["hashes"]:
            bad = sorted(k for k in set(actual) | set(meta["hashes"]) if actual.get(k) != meta["hashes"].get(k))
            raise ValueError(f"{path}: content hashes disagree for {bad[:5]}")
        return traj


@dataclass(frozen=True)
class Difference:
    """Where two trajectories first diverge: ``step`` (``None`` for run-level entries) and ``name``."""

    step: int | None
    name: str
    reason: str


def compare(a: Trajectory, b: Trajectory) -> Difference | None:
    """The first difference between ``a`` and ``b``, or ``None`` when every tensor's bits agree.

    Order: ``seed``, ``sample_id``, run-level tensors (by name), then transitions ascending and
    within a transition tensor names in sorted order. A name present in only one is a difference.
    """
    if a.seed != b.seed:
        return Difference(None, "seed", f"{a.seed} vs {b.seed}")
    if a.sample_id != b.sample_id:
        return Difference(None, "sample_id", f"{a.sample_id} vs {b.sample_id}")
    found = _first_in(None, a.run, b.run)
    if found:
        return found
    for k in range(max(len(a.steps), len(b.steps))):
        if k >= len(a.steps) or k >= len(b.steps):
            return Difference(k, "", f"step recorded in only one trajectory ({len(a.steps)} vs {len(b.steps)})")
        found = _first_in(k, a.steps[k], b.steps[k])
        if found:
            return found
    return None


def _first_in(step: int | None, a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> Difference | None:
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            return Difference(step, name, "present in only one trajectory")
        if tensor_hash(a[name]) != tensor_hash(b[name]):
            return Difference(step, name, "content differs")
    return None
