"""torch.compile(fullgraph=True) over timestep_sinusoid and timestep_mlp: the launchers are opaque
custom ops while tracing, so compiled outputs and gradients are eager's bits (graph and no-graph
paths), and the sinusoid's range read-back is the one thing a compiled caller opts out of."""

import pytest
import torch

import flowlock
from flowlock.ops.timestep import timestep_mlp, timestep_sinusoid
from flowlock.testing import assert_bitwise_equal

K, HIDDEN, EMBED = 256, 45, 27


def _sinusoid(t):
    with flowlock.use_backend("triton"):
        return timestep_sinusoid(t, check_range=False)


def _mlp(*args):
    with flowlock.use_backend("triton"):
        return timestep_mlp(*args)


def _compiled(fn):
    return torch.compile(fn, backend="aot_eager", fullgraph=True)


def _grads(fn, inputs, needs_grad, grad):
    leaves = [t.clone().requires_grad_(need) for t, need in zip(inputs, needs_grad)]
    out = fn(*leaves)
    out.backward(grad)
    return [out.detach()] + [leaf.grad for leaf in leaves if leaf.requires_grad]


def _no_grad(fn, inputs):
    with torch.no_grad():
        return fn(*(t.clone().requires_grad_() for t in inputs))


def test_sinusoid_compiled_equals_eager():
    g = torch.Generator().manual_seed(0)
    t = torch.cat([torch.tensor([0.0, 1.0]), torch.rand(3, generator=g)])
    grad = torch.randn(5, 2 * 128, generator=g)
    compiled = _compiled(_sinusoid)
    assert_bitwise_equal(_grads(compiled, [t], [True], grad), _grads(_sinusoid, [t], [True], grad))
    assert_bitwise_equal(_no_grad(compiled, [t]), _no_grad(_sinusoid, [t]))


@pytest.mark.parametrize("x_grad", [True, False])
def test_mlp_compiled_equals_eager(x_grad):
    """With and without d x: the backward op then returns the four parameter gradients only."""
    g = torch.Generator().manual_seed(1)
    inputs = [torch.randn(3, K, generator=g), torch.randn(HIDDEN, K, generator=g) / 16,
              torch.randn(HIDDEN, generator=g), torch.randn(EMBED, HIDDEN, generator=g) / HIDDEN ** 0.5,
              torch.randn(EMBED, generator=g)]
    grad = torch.randn(3, EMBED, generator=g)
    needs = [x_grad] + [True] * 4
    compiled = _compiled(_mlp)
    got = _grads(compiled, inputs, needs, grad)
    assert len(got) == 5 + x_grad
    assert_bitwise_equal(got, _grads(_mlp, inputs, needs, grad))
    assert_bitwise_equal(_no_grad(compiled, inputs), _no_grad(_mlp, inputs))


def test_sinusoid_range_check_is_optional_and_on_by_default():
    t = torch.tensor([0.5, 1.5])
    with flowlock.use_backend("triton"):
        with pytest.raises(ValueError, match="t values"):
            timestep_sinusoid(t)
        with pytest.raises(TypeError, match="t"):
            timestep_sinusoid(t.double(), check_range=False)
        unchecked = timestep_sinusoid(t, check_range=False)
    assert_bitwise_equal(unchecked[:1], _sinusoid(t[:1]))
