"""swiglu under torch.compile: forward and backward are opaque custom ops, so the compiled graph
launches the same kernels as eager and gives the same bits."""

import torch

import flowlock
from flowlock.ops.swiglu import swiglu
from flowlock.testing import assert_bitwise_equal


def _fn(h):
    with flowlock.use_backend("triton"):
        return swiglu(h)


def _fwd_bwd(fn, h, grad):
    h = h.detach().clone().requires_grad_(True)
    out = fn(h)
    out.backward(grad)
    return out.detach(), h.grad


def test_compiled_equals_eager():
    """Output and gradient with a graph, and the output of the no-graph path, bitwise equal to eager."""
    gen = torch.Generator().manual_seed(0)
    h = (torch.randn(2, 7, 2 * 37, generator=gen) * 4).bfloat16()
    grad = torch.randn(2, 7, 37, generator=gen).bfloat16()
    compiled = torch.compile(_fn, backend="aot_eager", fullgraph=True)
    assert_bitwise_equal(_fwd_bwd(compiled, h, grad), _fwd_bwd(_fn, h, grad), "compiled vs eager")
    with torch.no_grad():
        assert_bitwise_equal(compiled(h), _fn(h), "compiled vs eager, no graph")
