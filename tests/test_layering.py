"""Layers point down only: every flowlock -> flowlock import (module level or inside a function)
goes from a package to one strictly below it, so the packages form no circle."""

import ast
import pathlib

import flowlock

SRC = pathlib.Path(flowlock.__file__).parent
# Lower rank = lower layer. A module may import its own package and anything of lower rank.
RANK = {
    "flowlock.modes": 0,
    "flowlock.dispatch": 1,
    "flowlock.keys": 2,
    "flowlock.config": 3,
    "flowlock.testing": 4,
    "flowlock.ops": 4,
    "flowlock.patching": 5,
    "flowlock.rl": 5,
    "flowlock.parallel": 5,
    "flowlock.checkpoint": 5,
    "flowlock.models": 6,
    "flowlock": 7,
    "flowlock.integrations": 8,
    "flowlock.validate": 9,
    "flowlock.cli": 10,
    "flowlock.__main__": 11,
}


def _package(module: str) -> str:
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
