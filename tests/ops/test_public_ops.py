"""Every public op is reachable as ``flowlock.ops.<op>`` and is the family's own function."""

import importlib

import flowlock.ops

FAMILIES = ("adaln", "attention", "euler", "final_adaln", "gate_residual", "linear", "qk_norm_rope", "rms_norm",
            "rows", "segment_sum", "swiglu", "timestep")
# Goldens and references are the families' spec helpers, not ops.
NOT_OPS = {"attention_golden", "attention_reference", "linear_golden", "linear_reference"}


def test_every_family_export_is_a_flowlock_ops_name():
    exported = set()
    for family in FAMILIES:
        module = importlib.import_module(f"flowlock.ops.{family}")
        for name in set(module.__all__) - NOT_OPS:
            assert getattr(flowlock.ops, name) is getattr(module, name), name
            exported.add(name)
    assert exported == set(flowlock.ops.__all__)


def test_an_op_named_like_its_family_is_the_op_and_the_family_stays_importable():
    from flowlock.ops import linear, rms_norm

    assert callable(linear) and callable(rms_norm)
    assert importlib.import_module("flowlock.ops.linear").linear is linear
    from flowlock.ops.linear import linear_reference

    assert callable(linear_reference)
