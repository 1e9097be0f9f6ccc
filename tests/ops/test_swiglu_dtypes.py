"""swiglu in fp32 and fp16 (bf16: test_swiglu.py): eager parity, FP64-golden budgets, batch invariance."""

import pytest
import torch
import torch.nn.functional as F

import flowlock
from flowlock.ops.swiglu import swiglu
from flowlock.ops.swiglu.reference import swiglu_golden
from flowlock.testing import assert_batch_invariant, assert_bitwise_equal, assert_within_budget

DTYPES = (torch.float32, torch.float16)


def _h(shape, dtype, seed=0, scale=4.0):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def _run(backend, h, grad):
    h = h.clone().requires_grad_()
    with flowlock.use_backend(backend):
        out = swiglu(h)
    out.backward(grad)
    return out.detach(), h.grad


def _eager(h, grad):
    h = h.clone().requires_grad_()
    value, gate = h.chunk(2, dim=-1)
    out = value * F.silu(gate)
    out.backward(grad)
    return out.detach(), h.grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_forward_and_grad_within_fp64_budget(backend, dtype):
    h, grad = _h((3, 7, 2 * 45), dtype, 2), _h((3, 7, 45), dtype, 3, 1.0)
    out, dh = _run(backend, h, grad)
    base_out, base_dh = _eager(h, grad)
    h64 = h.double().requires_grad_()
    gold = swiglu_golden(h64, dtype)
    gold.backward(grad.double())
    assert out.dtype == dh.dtype == dtype
    assert_within_budget(out, gold.detach(), baseline=base_out, what=f"swiglu {dtype}")
    assert_within_budget(dh, h64.grad, baseline=base_dh, what=f"d h {dtype}")


def test_fp16_forward_bitwise_equal_to_eager():
    # fp16 keeps 11 bits: both roundings absorb the interpreter's exp against torch's
    h = _h((4, 9, 2 * 40), torch.float16, 7)
    with flowlock.use_backend("triton"):
        out = swiglu(h)
    value, gate = h.chunk(2, dim=-1)
    assert_bitwise_equal(out, value * F.silu(gate))


@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_invariant(dtype):
    pool = _h((16, 5, 2 * 33), dtype, 4)

    def fn(h):
        return _run("triton", h, torch.ones(h.shape[:-1] + (33,), dtype=dtype))

    assert_batch_invariant(fn, pool)
