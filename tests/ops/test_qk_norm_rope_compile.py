"""qk_norm_rope under torch.compile: forward and backward are opaque custom ops, so the compiled graph
launches the same kernels as eager and gives the same bits."""

import torch

import flowlock
from flowlock.ops.qk_norm_rope import qk_norm_rope
from flowlock.testing import assert_bitwise_equal

EPS = 1e-6


def _fn(x, w, cos, sin):
    with flowlock.use_backend("triton"):
        return qk_norm_rope(x, w, cos, sin, EPS)


def _fwd_bwd(fn, x, w, cos, sin, grad):
    x = x.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    out = fn(x, w, cos, sin)
    out.backward(grad)
    return out.detach(), x.grad, w.grad


def test_compiled_equals_eager():
    """Output, dx and dweight with a graph, and the output of the no-graph path, bitwise equal to eager."""
    gen = torch.Generator().manual_seed(0)
    b, s, heads, d, r = 2, 7, 3, 40, 24
    x = (torch.randn(b, s, heads, d, generator=gen) * 3).bfloat16()
    w = (torch.randn(d, generator=gen) * 0.3 + 1).bfloat16()
    angles = torch.arange(s, dtype=torch.float32)[:, None] * torch.rand(r // 2, generator=gen)[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos(), angles.sin()
    grad = torch.randn(b, s, heads, d, generator=gen).bfloat16()
    compiled = torch.compile(_fn, backend="aot_eager", fullgraph=True)
    eager = _fwd_bwd(_fn, x, w, cos, sin, grad)
    assert_bitwise_equal(_fwd_bwd(compiled, x, w, cos, sin, grad), eager, "compiled vs eager")
    with torch.no_grad():
        assert_bitwise_equal(compiled(x, w, cos, sin), eager[0], "compiled vs eager, no graph")
