"""pytest plugin for running diffusers' own H3 test file with every model strict-patched.

Load it with ``-p flowlock_strict_plugin`` (this folder on ``PYTHONPATH``) when running diffusers'
``tests/models/transformers/test_models_transformer_minimax_h3.py``. Environment:

* ``FLOWLOCK_SUITE_PATCH=strict`` (default) wraps ``MiniMaxH3Transformer3DModel.__init__`` so every
  model a test builds, directly, through ``from_config`` or through ``from_pretrained`` (which calls
  ``__init__`` before loading weights), gets ``flowlock.patch(model, mode="strict")`` as soon as it
  exists: before a test can register hooks (``enable_layerwise_casting``, offloading), which then wrap
  the strict path as flowlock documents. ``off`` patches nothing (the stock run), so both runs load
  the same plugin and report the same way.
* ``FLOWLOCK_SUITE_REPORT=path.json`` writes, per test id: its outcome (passed, failed, error,
  skipped, xfailed, xpassed), the first line of its failure, how many models were patched and how
  many strict root forwards ran (a passing test that never reached flowlock is visible), plus the
  diffusers version and path the tests imported.

A developer tool (tools/diffusers_h3_suite.sh), not part of flowlock's CI.
"""

from __future__ import annotations

import functools
import json
import os

import pytest

_COUNTS = {"patched": 0, "strict_forwards": 0}
_TESTS: dict[str, dict] = {}
_MODE = os.environ.get("FLOWLOCK_SUITE_PATCH", "strict")


def _install_strict_patch():
    from diffusers import MiniMaxH3Transformer3DModel

    import flowlock
    import flowlock.models.minimax_h3.patch as patch_module

    cls = MiniMaxH3Transformer3DModel
    if getattr(cls.__init__, "__flowlock_suite__", False):
        return
    original_init = cls.__init__

    @functools.wraps(original_init)  # inspect.signature (read by ConfigMixin) follows __wrapped__
    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        if type(self) is cls:  # a subclass's own __init__ body would still be running
            flowlock.patch(self, mode="strict")
            _COUNTS["patched"] += 1

    __init__.__flowlock_suite__ = True
    cls.__init__ = __init__

    # The patched root forward looks strict_forward up in this module at call time: count the calls there.
    original_forward = patch_module.strict_forward

    @functools.wraps(original_forward)
    def counting_forward(*args, **kwargs):
        _COUNTS["strict_forwards"] += 1
        return original_forward(*args, **kwargs)

    patch_module.strict_forward = counting_forward


def pytest_configure(config):
    if _MODE not in ("strict", "off"):
        raise pytest.UsageError(f"FLOWLOCK_SUITE_PATCH must be 'strict' or 'off', got {_MODE!r}")
    if _MODE == "strict":
        _install_strict_patch()


def pytest_report_header(config):
    import diffusers

    what = "every MiniMaxH3Transformer3DModel strict-patched" if _MODE == "strict" else "stock (nothing patched)"
    return f"flowlock suite plugin: {what}; diffusers {diffusers.__version__} from {diffusers.__file__}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    before = dict(_COUNTS)
    _TESTS[item.nodeid] = {"outcome": None, "message": ""}
    yield
    _TESTS[item.nodeid].update({k: _COUNTS[k] - before[k] for k in _COUNTS})


def _message(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr or "")
    if isinstance(report.longrepr, tuple):  # a skip: (path, line, reason)
        text = report.longrepr[2]
    return text.strip().splitlines()[0] if text.strip() else ""


def pytest_runtest_logreport(report):
    entry = _TESTS.setdefault(report.nodeid, {"outcome": None, "message": ""})
    if entry["outcome"] in ("failed", "error"):
        return
    xfail = hasattr(report, "wasxfail")
    if report.failed:
        entry["outcome"] = "failed" if report.when == "call" else "error"
        entry["message"] = (f"[{report.when}] " if report.when != "call" else "") + _message(report)
    elif report.skipped:
        entry["outcome"] = "xfailed" if xfail else "skipped"
        entry["message"] = report.wasxfail if xfail else _message(report)
    elif report.when == "call":
        entry["outcome"] = "xpassed" if xfail else "passed"


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("FLOWLOCK_SUITE_REPORT")
    if path:
        import diffusers

        with open(path, "w") as f:
            json.dump({"patch": _MODE, "diffusers": diffusers.__version__, "diffusers_path": diffusers.__file__,
                       "tests": _TESTS}, f, indent=1, sort_keys=True)
