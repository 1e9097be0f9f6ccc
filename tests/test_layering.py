"""Layers point down only: every flowlock -> flowlock import (module level or inside a function)
goes from a package to one strictly below it, so the packages form no circle. Inside ``models`` and
``integrations`` the generic machinery ranks below the model families' wings, so no generic room
imports a family."""

import ast
import pathlib

import flowlock

SRC = pathlib.Path(flowlock.__file__).parent
# Lower rank = lower layer. A module may import its own package and anything of lower rank. A module
# belongs to the longest package named here that contains it (else to flowlock.<its top package>).
RANK = {
    "flowlock.modes": 0,
    "flowlock.dispatch": 1,
    "flowlock.finite": 1,
    "flowlock.keys": 2,
    "flowlock.config": 3,
    "flowlock.testing": 4,
    "flowlock.ops": 4,
    "flowlock.patching": 5,
    "flowlock.cuda_graphs": 5,
    "flowlock.rl": 5,
    "flowlock.parallel": 5,
    "flowlock.checkpoint": 5,
    "flowlock.patch_guard": 5.5,  # above the walk it reuses (cuda_graphs) and patching, below models
    "flowlock.models.common": 6,
    "flowlock.models": 7,
    "flowlock": 8,
    "flowlock.integrations": 9,
    "flowlock.integrations.vllm_omni.minimax_h3": 10,
    "flowlock.validate": 11,
    "flowlock.cli": 12,
    "flowlock.__main__": 13,
}


def _package(module: str) -> str:
    ranked = [name for name in RANK if module == name or module.startswith(name + ".")]
    ranked = [name for name in ranked if name != "flowlock" or module == "flowlock"]
    if ranked:
        return max(ranked, key=len)
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def _imports(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module, node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno


def _upward_imports(src: pathlib.Path = SRC) -> list[str]:
    found = []
    for path in sorted(src.rglob("*.py")):
        module = ".".join(path.relative_to(src.parent).with_suffix("").parts).removesuffix(".__init__")
        here = _package(module)
        for target, line in _imports(path):
            if not target.startswith("flowlock"):
                continue
            there = _package(target)
            if there != here and RANK[there] >= RANK[here]:
                found.append(f"{path.relative_to(src.parent)}:{line} {here} -> {there}")
    return found


def test_every_package_has_a_rank():
    packages = {_package(".".join(p.relative_to(SRC.parent).with_suffix("").parts).removesuffix(".__init__"))
                for p in SRC.rglob("*.py")}
    assert packages <= set(RANK), sorted(packages - set(RANK))


def test_imports_point_down_only():
    assert _upward_imports() == []


def test_the_check_sees_an_upward_import(tmp_path):
    planted = tmp_path / "flowlock" / "rl" / "planted.py"
    planted.parent.mkdir(parents=True)
    planted.write_text("def f():\n    from flowlock.models.minimax_h3 import tiny_h3\n")
    assert _upward_imports(tmp_path / "flowlock") == ["flowlock/rl/planted.py:2 flowlock.rl -> flowlock.models"]


def test_the_check_sees_generic_machinery_importing_a_family(tmp_path):
    for room, family in (("models/common", "flowlock.models.minimax_h3.strict"),
                         ("integrations/vllm_omni", "flowlock.integrations.vllm_omni.minimax_h3.forward")):
        planted = tmp_path / "flowlock" / room / "planted.py"
        planted.parent.mkdir(parents=True)
        planted.write_text(f"import {family}\n")
    assert _upward_imports(tmp_path / "flowlock") == [
        "flowlock/integrations/vllm_omni/planted.py:1 flowlock.integrations -> "
        "flowlock.integrations.vllm_omni.minimax_h3",
        "flowlock/models/common/planted.py:1 flowlock.models.common -> flowlock.models"]


# torch.distributed calls that move data between ranks, and the DTensor methods that issue them
COLLECTIVES = {"all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_to_all",
               "all_to_all_single", "reduce_scatter", "reduce_scatter_tensor", "broadcast", "broadcast_object_list",
               "reduce", "gather", "scatter", "send", "recv", "isend", "irecv", "barrier", "monitored_barrier"}
DTENSOR_COLLECTIVES = {"full_tensor", "redistribute"}


def _is_distributed(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and node.id == "dist") or (
        isinstance(node, ast.Attribute) and node.attr == "distributed")


def _collectives_outside_parallel(src: pathlib.Path = SRC) -> list[str]:
    found = []
    for path in sorted(src.rglob("*.py")):
        if path.relative_to(src).parts[0] == "parallel":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            attr = node.func.attr
            if (attr in COLLECTIVES and _is_distributed(node.func.value)) or attr in DTENSOR_COLLECTIVES:
                found.append(f"{path.relative_to(src.parent)}:{node.lineno} {attr}")
    return found


def test_collectives_are_issued_in_parallel_only():
    assert _collectives_outside_parallel() == []


def test_the_check_sees_a_collective_outside_parallel(tmp_path):
    planted = tmp_path / "flowlock" / "validate" / "planted.py"
    planted.parent.mkdir(parents=True)
    planted.write_text("import torch.distributed as dist\n\ndef f(t, g):\n    dist.all_reduce(t)\n"
                       "    torch.distributed.barrier()\n    return g.full_tensor()\n")
    (tmp_path / "flowlock" / "parallel").mkdir()
    (tmp_path / "flowlock" / "parallel" / "ok.py").write_text("import torch.distributed as dist\ndist.all_reduce(1)\n")
    assert _collectives_outside_parallel(tmp_path / "flowlock") == [
        "flowlock/validate/planted.py:4 all_reduce", "flowlock/validate/planted.py:5 barrier",
        "flowlock/validate/planted.py:6 full_tensor"]
