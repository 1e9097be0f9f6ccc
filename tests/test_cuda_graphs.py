"""flowlock.cuda_graphs on the CPU: what ``capture`` refuses before anything runs, and what a
``CapturedCall`` checks, copies and rebinds around a replay. A stand-in graph re-runs the call into
the captured outputs; the capture itself (and bitwise equality with eager) is tested on the GPU in
tests/models/test_h3_graphed_gpu.py."""

import pytest
import torch
from torch import nn

from flowlock.cuda_graphs import CapturedCall, GraphInvalidated, capture


class Rerun:
    """Stands in for a captured graph: ``replay`` runs the call again and writes its outputs and
    gradients into the tensors the capture returned, as a graph replay writes into its own."""

    def __init__(self, fn, static, outputs, params):
        self.fn, self.static, self.outputs, self.params = fn, static, outputs, params
        self.grads = [p.grad for p in params]
        self.replays = 0

    def replay(self):
        for p in self.params:
            p.grad = None
        self.outputs.copy_(self.fn(**self.static))
        for p, g in zip(self.params, self.grads):
            g.copy_(p.grad)
            p.grad = g
        self.replays += 1


def _captured(validate=None, fixed=("index",)):
    linear = nn.Linear(3, 2)

    def step(x, index):
        out = linear(x)[index]
        out.sum().backward()
        return out.detach()

    static = {"x": torch.randn(4, 3), "index": torch.tensor([0, 2])}
    outputs = step(**static)
    graph = Rerun(step, static, outputs, list(linear.parameters()))
    return CapturedCall(graph, static, outputs, fixed=fixed, validate=validate, modules=[linear]), linear, graph


def test_a_call_copies_updates_replays_and_rebinds_gradients():
    captured, linear, graph = _captured()
    grad = linear.weight.grad
    x = torch.randn(4, 3)
    linear.zero_grad(set_to_none=True)
    out = captured(x=x)
    assert graph.replays == 1 and out is captured.outputs
    assert torch.equal(out, linear(x)[[0, 2]].detach())
    assert linear.weight.grad is grad
    assert torch.equal(grad, x[[0, 2]].sum(0).expand(2, 3))


@pytest.mark.parametrize("updates, error, match", [
    ({"y": torch.zeros(4, 3)}, ValueError, "unknown input 'y'"),
    ({"index": torch.tensor([1, 3])}, ValueError, "fixed by the capture"),
    ({"x": torch.zeros(4, 4)}, ValueError, r"must be \(4, 3\) torch.float32"),
    ({"x": torch.zeros(4, 3, dtype=torch.float64)}, ValueError, "must be"),
    ({"x": [0.0]}, TypeError, "must be a tensor"),
])
def test_bad_updates_refused_before_anything_is_copied(updates, error, match):
    captured, _, graph = _captured()
    before = captured._static["x"].clone()
    with pytest.raises(error, match=match):
        captured(**{"x": torch.ones(4, 3), **updates} if "x" not in updates else updates)
    assert graph.replays == 0 and torch.equal(captured._static["x"], before)


def test_validate_sees_the_updates_and_refuses_before_the_copy():
    seen = []

    def validate(inputs):
        seen.append(inputs["x"])
        if (inputs["x"] < 0).any():
            raise ValueError("x must be non-negative")

    captured, _, graph = _captured(validate=validate)
    before = captured._static["x"].clone()
    bad = -torch.ones(4, 3)
    with pytest.raises(ValueError, match="non-negative"):
        captured(x=bad)
    assert seen[-1] is bad and graph.replays == 0 and torch.equal(captured._static["x"], before)
    captured(x=torch.ones(4, 3))
    assert graph.replays == 1


def test_a_rebound_weight_invalidates_the_graph_an_in_place_update_does_not():
    captured, linear, graph = _captured()
    with torch.no_grad():
        linear.weight.mul_(2)
    captured()
    linear.bias.data = linear.bias.data.clone()
    with pytest.raises(GraphInvalidated, match="0.bias changed storage"):
        captured()
    assert graph.replays == 1
    captured, linear, graph = _captured()
    linear.weight = nn.Parameter(linear.weight.detach().clone())
    with pytest.raises(GraphInvalidated, match="0.weight"):
        captured()
    captured, linear, graph = _captured()
    linear.register_buffer("extra", torch.zeros(1))
    with pytest.raises(GraphInvalidated, match="3 parameters and buffers, 2 at capture"):
        captured()
    # what accelerate's set_module_tensor_to_device does: a new tensor straight into the registration dict
    captured, linear, graph = _captured()
    linear._parameters["bias"] = nn.Parameter(linear.bias.detach().clone())
    with pytest.raises(GraphInvalidated, match="0.bias changed storage"):
        captured()


def test_the_storage_walk_sees_what_named_parameters_and_buffers_see():
    from flowlock.cuda_graphs import registered_tensor_names, registered_tensors
    from flowlock.models.minimax_h3.tiny import tiny_h3

    model = tiny_h3()
    model.transformer_blocks[0].register_buffer("extra", torch.zeros(2))
    model.transformer_blocks[1].shared = model.transformer_blocks[0].ff  # one module in two places
    outside = nn.Linear(2, 2)
    named = [(f"0.{n}", t) for n, t in model.named_parameters(remove_duplicate=False)]
    named += [(f"0.{n}", t) for n, t in model.named_buffers(remove_duplicate=False)]
    named += [(f"1.{n}", t) for n, t in outside.named_parameters(remove_duplicate=False)]
    walked = list(zip(registered_tensor_names([model, outside]), registered_tensors([model, outside])))
    assert sorted((n, id(t)) for n, t in walked) == sorted((n, id(t)) for n, t in named)


def test_release_drops_the_graph_and_its_gradients():
    captured, linear, _ = _captured()
    captured.release()
    assert linear.weight.grad is None and linear.bias.grad is None and captured.outputs is None
    with pytest.raises(GraphInvalidated, match="released"):
        captured()


def test_capture_refuses_before_running_anything():
    ran = []

    def fn(**inputs):
        ran.append(1)

    linear = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="CUDA tensor"):
        capture(fn, {"x": torch.zeros(2)})
    with pytest.raises(ValueError, match="fixed names no input: y"):
        capture(fn, {"x": torch.zeros(2)}, fixed=["y"])
    with pytest.raises(ValueError, match="warmup must be at least 1"):
        capture(fn, {"x": torch.zeros(2)}, warmup=0)
    linear(torch.zeros(1, 2)).sum().backward()
    with pytest.raises(ValueError, match="no .grad at capture.*bias, weight"):
        capture(fn, {}, modules=[linear])
    assert not ran


def test_an_input_that_requires_grad_takes_updates_and_exposes_its_gradient():
    x = torch.randn(3, requires_grad=True)
    (x * 2).sum().backward()

    class Idle:
        def replay(self):
            pass

    captured = CapturedCall(Idle(), {"x": x}, None)
    assert captured.input_grads["x"] is x.grad
    captured(x=torch.ones(3))
    assert torch.equal(x.detach(), torch.ones(3)) and x.requires_grad
