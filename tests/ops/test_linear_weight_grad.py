"""``linear_weight_grad`` gives the bits of ``linear``'s own backward (dW, dBias) from ``x`` and ``dy``,
on both backends, and validates before computing."""

import pytest
import torch

import flowlock
from flowlock.ops.linear import linear, linear_weight_grad
from flowlock.testing import assert_bitwise_equal


def _case(dtype, bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 37, 48, generator=gen).to(dtype)
    w = (torch.randn(40, 48, generator=gen) * 0.1).to(dtype)
    b = (torch.randn(40, generator=gen) * 0.1).to(dtype) if bias else None
    dy = torch.randn(2, 37, 40, generator=gen).to(dtype)
    return x, w, b, dy


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [True, False])
def test_equals_the_backward_of_linear(backend, dtype, bias):
    x, w, b, dy = _case(dtype, bias)
    leaves = [t.clone().requires_grad_() for t in (w, b) if t is not None]
    with flowlock.use_backend(backend):
        out = linear(x.clone().requires_grad_(), leaves[0], leaves[1] if bias else None)
        out.backward(dy)
        dw, db = linear_weight_grad(x, dy, w, b)
    assert_bitwise_equal(dw, leaves[0].grad, "dW")
    if bias:
        assert_bitwise_equal(db, leaves[1].grad, "dBias")
    else:
        assert db is None


def test_bad_dy_is_refused():
    x, w, b, dy = _case(torch.bfloat16, True)
    with pytest.raises(ValueError, match="dy"):
        linear_weight_grad(x, dy[:, :5], w, b)
    with pytest.raises(TypeError, match="dy"):
        linear_weight_grad(x, dy.float(), w, b)
