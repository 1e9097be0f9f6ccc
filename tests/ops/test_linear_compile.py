"""linear under torch.compile: the forward and each backward product (dX, dW, dBias) are opaque custom
ops, so the compiled graph launches the same kernels as eager and gives the same bits."""

import pytest
import torch

import flowlock
from flowlock.ops.linear import linear
from flowlock.testing import assert_bitwise_equal

BF16, FP32 = torch.bfloat16, torch.float32


def _grads(fn, x, w, b, dy, trainable):
    """``(out, grads of the inputs named in trainable)``; the others stay frozen."""
    leaves = [t.detach().clone().requires_grad_(name in trainable) if t is not None else None
              for name, t in zip("xwb", (x, w, b))]
    out = fn(*leaves)
    live = [t for t in leaves if t is not None and t.requires_grad]
    return (out.detach(), *torch.autograd.grad(out, live, dy.to(out.dtype)))


@pytest.mark.parametrize("dtype,out_dtype,bias,trainable", [
    (BF16, None, True, "xwb"),
    (BF16, FP32, True, "wb"),
    (FP32, None, False, "x"),
])
def test_compiled_equals_eager(dtype, out_dtype, bias, trainable):
    """Output and every input gradient with a graph, and the output of the no-graph path, bitwise
    equal to eager; leading dims (2, 7) flatten to M = 14 rows, N = 40 and K = 24 are not tile multiples."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 7, 24, generator=gen).to(dtype)
    w = (torch.randn(40, 24, generator=gen) / 24 ** 0.5).to(dtype)
    b = torch.randn(40, generator=gen).to(dtype) if bias else None
    dy = torch.randn(2, 7, 40, generator=gen)

    def fn(x, w, b):
        with flowlock.use_backend("triton"):
            return linear(x, w, b, out_dtype=out_dtype)

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    eager = _grads(fn, x, w, b, dy, trainable)
    assert_bitwise_equal(_grads(compiled, x, w, b, dy, trainable), eager, "compiled vs eager")
    with torch.no_grad():
        assert_bitwise_equal(compiled(x, w, b), eager[0], "compiled vs eager, no graph")
