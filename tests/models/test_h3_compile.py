"""torch.compile on the patched tiny H3: one graph per repeated block class with regional
compilation, one graph for the whole model, no graph breaks (``fullgraph=True``), never the recompile
limit, and the compiled forward and backward bitwise equal to eager.

The model has one block more than dynamo's recompile limit, so a per-instance guard would fail
``fullgraph=True`` here. Graphs are counted by a backend that records each graph dynamo hands it and
runs it as captured; ``aot_eager`` adds AOTAutograd's joint forward/backward trace.
"""

import pytest
import torch
from h3_helpers import forward_backward

import flowlock
from flowlock.models.minimax_h3 import tiny_inputs
from flowlock.models.minimax_h3.strict import compiled_rope_cos_sin
from flowlock.models.minimax_h3.tiny import TINY_H3_CONFIG, make_h3
from flowlock.testing import assert_bitwise_equal


def _deep_h3():
    # More blocks of each repeated class than dynamo compiles versions of one frame.
    blocks = torch._dynamo.config.recompile_limit + 1
    return make_h3(dict(TINY_H3_CONFIG, num_layers=blocks, num_refiner_layers=blocks))


class _CountingBackend:
    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward


def _compile(model, how, backend):
    if how == "regional":
        model.compile_repeated_blocks(fullgraph=True, backend=backend)
        return model
    return torch.compile(model, fullgraph=True, backend=backend)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _forward_backward(compiled, inputs):
    out, grads = forward_backward(compiled, inputs, input_grad=True)
    # torch.compile(model) wraps the model: its parameter names gain a "_orig_mod." prefix.
    return out, {name.removeprefix("_orig_mod."): grad for name, grad in grads.items()}


# Whole-model compilation inlines every block into one frame, so depth cannot reach the recompile
# limit there; the 2-block model keeps that trace short.
@pytest.mark.parametrize("how, graphs, build", [("regional", 2, _deep_h3),
                                                ("whole", 1, lambda: make_h3(TINY_H3_CONFIG))])
def test_one_graph_per_block_class_and_bitwise_eager(how, graphs, build):
    model, inputs = build(), tiny_inputs(2)
    with flowlock.patch(model):
        eager = forward_backward(model, inputs, input_grad=True)
        backend = _CountingBackend()
        compiled = _compile(model, how, backend)
        first = _forward_backward(compiled, inputs)
        again = _forward_backward(compiled, tiny_inputs(2, seed=1))
    # regional: the transformer block and the refiner block, each traced once for all its instances.
    assert len(backend.graphs) == graphs
    assert all(torch.isfinite(t).all() for t in again[0])
    assert_bitwise_equal(first[0], eager[0], f"{how} compiled outputs")
    assert first[1].keys() == eager[1].keys()
    assert_bitwise_equal([first[1][k] for k in eager[1]], list(eager[1].values()), f"{how} compiled gradients")


def test_aot_autograd_trace_is_bitwise_eager_forward_and_backward():
    model, inputs = _deep_h3(), tiny_inputs(2, seed=3)
    with flowlock.patch(model):
        eager = forward_backward(model, inputs, input_grad=True)
        model.compile_repeated_blocks(fullgraph=True, backend="aot_eager")
        compiled = forward_backward(model, inputs, input_grad=True)
    assert_bitwise_equal(compiled[0], eager[0], "aot_eager outputs")
    assert_bitwise_equal(list(compiled[1].values()), list(eager[1].values()), "aot_eager gradients")


def test_compiled_model_still_checks_the_layout_in_the_graph():
    model, inputs = make_h3(TINY_H3_CONFIG), tiny_inputs(1)
    with flowlock.patch(model), torch.no_grad():
        backend = _CountingBackend()
        compiled = _compile(model, "whole", backend)
        compiled(**inputs)
        overlapping = dict(inputs, audio_indices=inputs["audio_indices"].clone())
        overlapping["audio_indices"][0] = inputs["text_indices"][0]
        with pytest.raises(RuntimeError, match="unique and disjoint"):
            compiled(**overlapping)
        out_of_range = dict(inputs, token_tags=inputs["token_tags"].clone())
        out_of_range["token_tags"][0] = 3
        with pytest.raises(RuntimeError, match=r"token_tags values must lie in \[0, 3\)"):
            compiled(**out_of_range)
        with pytest.raises(RuntimeError, match="timestep values"):
            compiled(**dict(inputs, timestep=inputs["timestep"] * 1000))
    assert len(backend.graphs) == 1


def test_rope_tables_are_one_opaque_node_with_eager_bits_under_inductor(monkeypatch):
    # Inductor's compile-time allocations include leaves that require grad, which the session's
    # in-place poisoning of torch.empty* cannot fill; nothing here reads an unwritten allocation.
    for name in ("empty", "empty_like", "empty_strided"):
        monkeypatch.setattr(torch, name, getattr(torch._C._VariableFunctions, name))
    model, positions = make_h3(TINY_H3_CONFIG), tiny_inputs(1)["position_ids"]
    compiled = torch.compile(compiled_rope_cos_sin, fullgraph=True, backend="inductor")
    assert_bitwise_equal(compiled(model.rope.inv_freq, positions), model.rope(positions), "inductor rope tables")


@pytest.mark.parametrize("mode", ["strict", "audit"])
def test_mode_frames_around_compiled_calls_add_no_recompiles(mode):
    # A frame records which ops ran; that bookkeeping is Python state a graph would guard on.
    model = _deep_h3()
    with flowlock.patch(model):
        backend = _CountingBackend()
        model.compile_repeated_blocks(fullgraph=True, backend=backend)
        for seed in (0, 1):
            with flowlock.mode(mode) as frame:
                forward_backward(model, tiny_inputs(2, seed=seed), input_grad=True)
            assert not frame.fallbacks
    assert len(backend.graphs) == 2
