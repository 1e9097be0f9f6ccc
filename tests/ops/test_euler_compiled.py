"""torch.compile(fullgraph=True) over euler_step: forward and backward are opaque custom ops while
tracing, so compiled outputs and gradients are eager's bits on the graph and no-graph paths."""

import pytest
import torch

import flowlock
from flowlock.ops.euler import euler_step
from flowlock.testing import assert_bitwise_equal


def _step(sample, velocity, timestep, sigma, sigma_next):
    with flowlock.use_backend("triton"):
        return euler_step(sample, velocity, timestep, sigma, sigma_next, check_schedule=False)


def _grads(fn, sample, velocity, schedule, grad):
    leaves = [sample.clone().requires_grad_(), velocity.clone().requires_grad_()]
    out = fn(*leaves, *schedule)
    out.backward(grad)
    return out.detach(), *(leaf.grad for leaf in leaves)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("per_sample", [True, False])
def test_compiled_equals_eager(dtype, per_sample):
    g = torch.Generator().manual_seed(0)
    sample, velocity, grad = (torch.randn(3, 5, 7, generator=g).to(dtype) for _ in range(3))
    if per_sample:
        schedule = (torch.tensor([0.9, 0.5, 0.13]), torch.tensor([0.8, 0.6, 0.2]), torch.tensor([0.7, 0.31, 0.0]))
    else:
        schedule = (torch.tensor(0.37), torch.tensor(0.71), torch.tensor(0.52))
    compiled = torch.compile(_step, backend="aot_eager", fullgraph=True)
    assert_bitwise_equal(_grads(compiled, sample, velocity, schedule, grad),
                         _grads(_step, sample, velocity, schedule, grad))
    with torch.no_grad():
        leaves = (sample.clone().requires_grad_(), velocity.clone().requires_grad_())
        assert_bitwise_equal(compiled(*leaves, *schedule), _step(*leaves, *schedule))
