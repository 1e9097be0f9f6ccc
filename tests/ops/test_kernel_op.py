"""``flowlock.ops._kernel_op``: a flowlock operator's call reaches its kernel through the dispatcher alone
(no Python layer of ``torch.library.custom_op`` in between, which cost the compiled strict step its
host time), traces to one opaque node with its fake, and every launcher op is registered this way."""

import sys

import pytest
import torch

from flowlock.ops._kernel_op import KernelOp, kernel_op


def _python_frames_between(kernel_name: str) -> list[str]:
    frames, frame = [], sys._getframe(1)
    while frame is not None and frame.f_code.co_name != kernel_name:
        frame = frame.f_back
    frame = frame.f_back if frame is not None else None
    while frame is not None and frame.f_code.co_name != "_call_site":
        frames.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")
        frame = frame.f_back
    return frames


def _call_site(op, x):
    return op(x)


SEEN: dict[str, list[str]] = {}


@kernel_op("flowlock::test_kernel_op_double")
def _double(x: torch.Tensor) -> torch.Tensor:
    SEEN["frames"] = _python_frames_between("_double")
    return x * 2


@_double.register_fake
def _(x):
    return torch.empty_like(x)


def _names(frames: list[str]) -> list[str]:
    return [f"{f.rsplit('/', 1)[-1]}" for f in frames]


def test_call_reaches_the_kernel_through_the_dispatcher_alone():
    x = torch.arange(4.0)
    assert torch.equal(_call_site(_double, x), x * 2)
    # OpOverload.__call__ (the dispatcher's entry) and KernelOp.__call__, nothing else
    assert _names(SEEN["frames"]) == ["_ops.py:__call__", "_kernel_op.py:__call__"], SEEN["frames"]
    _call_site(_double.op, x)
    assert _names(SEEN["frames"]) == ["_ops.py:__call__"], SEEN["frames"]


@torch.library.custom_op("flowlock_test::double_custom", mutates_args=())
def _double_custom(x: torch.Tensor) -> torch.Tensor:
    SEEN["frames"] = _python_frames_between("_double_custom")
    return x * 2


def test_the_frame_count_tells_a_custom_op_apart():
    _call_site(_double_custom, torch.arange(4.0))
    names = _names(SEEN["frames"])
    assert "custom_ops.py:backend_impl" in names and "autograd.py:autograd_impl" in names, names


def test_compiled_graph_holds_one_opaque_node_with_the_fake_shapes():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    fn = torch.compile(lambda x: _double(x) + 1, backend="aot_eager", fullgraph=True)
    x = torch.arange(6.0).view(2, 3)
    assert torch.equal(fn(x), x * 2 + 1)
    counted = torch.compile(lambda x: _double(x), backend=backend, fullgraph=True)
    counted(x)
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert targets == [torch.ops.flowlock.test_kernel_op_double.default]


def test_only_the_flowlock_namespace():
    with pytest.raises(ValueError, match="flowlock namespace"):
        kernel_op("other::name", lambda x: x)


def test_every_launcher_op_is_a_kernel_op():
    import flowlock.models.minimax_h3.strict as strict
    from flowlock.ops.attention import triton as attention
    from flowlock.ops.linear import triton as linear
    from flowlock.ops.rms_norm import triton as rms_norm

    ops = [attention.attention_fwd_op, attention._attention_bwd_op, linear._linear_fwd_op, linear._linear_bwd_dw_op,
           rms_norm._rms_norm_modulate_bwd_op, strict.compiled_rope_cos_sin]
    assert all(isinstance(op, KernelOp) for op in ops)
