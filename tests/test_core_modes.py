import pytest
import torch

import flowlock
from flowlock.dispatch import backend_for
from flowlock.modes import StrictModeError, fallback_or_raise


def test_default_mode_is_strict():
    assert flowlock.current_mode() == "strict"


def test_modes_nest_and_restore_even_on_error():
    with flowlock.mode("audit") as outer:
        with pytest.raises(KeyError):
            with flowlock.mode("provider"):
                assert flowlock.current_mode() == "provider"
                raise KeyError("boom")
        assert flowlock.current_mode() == "audit"
        assert outer.mode == "audit"
    assert flowlock.current_mode() == "strict"


def test_handle_api_restores_innermost_first():
    a = flowlock.set_mode("audit")
    b = flowlock.set_mode("provider")
    with pytest.raises(RuntimeError, match="innermost"):
        a.restore()
    b.restore()
    a.restore()
    assert flowlock.current_mode() == "strict"
    with pytest.raises(RuntimeError, match="already"):
        a.restore()


def test_unknown_mode_rejected():
    with pytest.raises(ValueError, match="mode must be one of"):
        flowlock.set_mode("fast")


def test_strict_never_falls_back_and_audit_records():
    with pytest.raises(StrictModeError, match="never falls back"):
        fallback_or_raise("linear", "unsupported module")
    with flowlock.mode("audit") as handle:
        fallback_or_raise("linear", "unsupported module")
    assert [(f.op, f.reason) for f in handle.fallbacks] == [("linear", "unsupported module")]


def test_backend_readback_and_device_rules():
    x = torch.zeros(2)
    with flowlock.mode("strict") as handle:
        assert backend_for("op_a", x, None) == "reference"
        with flowlock.use_backend("triton"):
            assert backend_for("op_b", x) == "triton"
    assert handle.ran == [("op_a", "reference"), ("op_b", "triton")]
    with pytest.raises(ValueError, match="backend must be one of"):
        with flowlock.use_backend("cuda"):
            pass


def test_triton_on_cpu_needs_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with flowlock.use_backend("triton"):
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            backend_for("op", torch.zeros(1))


def test_no_side_effects_at_import():
    import subprocess
    import sys

    code = ("import torch; before = torch.backends.cuda.matmul.allow_tf32; import flowlock; "
            "assert flowlock.current_mode() == 'strict'; "
            "assert torch.backends.cuda.matmul.allow_tf32 == before")
    subprocess.run([sys.executable, "-c", code], check=True)
