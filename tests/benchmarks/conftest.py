"""Shared by the benchmark scripts' CPU tests: a script from ``benchmarks/`` imported as a module."""

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def load_bench(monkeypatch):
    """``load_bench("bench_x")``: ``benchmarks/bench_x.py`` imported afresh, with ``benchmarks/`` on
    ``sys.path`` (for its ``harness`` and ``plot``) and the Triton interpreter on, both undone after."""
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.setenv("TRITON_INTERPRET", "1")

    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load
