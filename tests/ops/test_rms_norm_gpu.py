"""Norms family on a CUDA GPU (compiled Triton): the eager-parity, invariance and repeatability
promises at H3 widths, where FMA contraction and compiled reduction trees would show."""

import pytest
import torch
from rms_norm_cases import modulate_case

from flowlock.ops.gate_residual import gate_residual
from flowlock.ops.rms_norm import rms_norm, rms_norm_modulate
from flowlock.ops.rms_norm.reference import rms_norm_golden
from flowlock.ops.segment_sum import segment_sum
from flowlock.ops.segment_sum.reference import segment_sum_golden
from flowlock.testing import (
    assert_batch_invariant,
    assert_bitwise_equal,
    assert_repeatable,
    assert_within_budget,
)

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
H, S, R, EPS = 5376, 1031, 6, 1e-5


def _case(dtype, lead=(2,), seed=0):
    return modulate_case(lead, S, H, R, dtype, seed, DEVICE)


def _grads(fn, leaves, dy):
    leaves = [t.detach().clone().requires_grad_(True) for t in leaves]
    out = fn(*leaves)
    out.backward(dy)
    return (out.detach(), *(t.grad for t in leaves))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gate_residual_forward_and_dy_bitwise_equal_to_eager(dtype):
    x, _, table, index, dy = _case(dtype)
    y = torch.randn_like(x)
    gate = table[:, 2 * H:3 * H]
    got = _grads(lambda a, b: gate_residual(a, gate, b, index), [x, y], dy)
    want = _grads(lambda a, b: a + gate.to(dtype).index_select(0, index) * b, [x, y], dy)
    assert_bitwise_equal(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_modulation_bitwise_equal_to_eager_given_the_same_norm(dtype):
    x, weight, table, index, _ = _case(dtype)
    shift, scale = table[:, :H], table[:, H:2 * H]
    n = rms_norm(x, weight, EPS)
    eager = n * (1.0 + scale.to(dtype).index_select(0, index)) + shift.to(dtype).index_select(0, index)
    assert_bitwise_equal(rms_norm_modulate(x, weight, shift, scale, index, EPS), eager)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_within_budget_of_fp64(dtype):
    x, weight, _, _, _ = _case(dtype)
    eager = torch.nn.functional.rms_norm(x, (H,), weight, EPS)
    assert_within_budget(rms_norm(x, weight, EPS), rms_norm_golden(x, weight, EPS), baseline=eager)


def test_segment_sum_within_budget_and_repeatable():
    x, _, _, index, _ = _case(torch.bfloat16, lead=())
    out = segment_sum(x, index, R)
    baseline = torch.zeros(R, H, device=DEVICE).index_add_(0, index, x.float())
    assert_within_budget(out, segment_sum_golden(x, index, R), baseline=baseline)
    assert_repeatable(lambda: segment_sum(x, index, R), runs=100)


def test_batch_invariant_forward_and_per_sample_gradients():
    x, weight, table, index, dy = _case(torch.bfloat16, lead=(16,))
    shift, scale, gate = table[:, :H], table[:, H:2 * H], table[:, 2 * H:3 * H]

    def run(xb, dyb):
        out, dx = _grads(lambda a: rms_norm_modulate(a, weight, shift, scale, index, EPS), [xb], dyb)
        res, _, dy_g = _grads(lambda a, b: gate_residual(a, gate, b, index), [xb, out], dyb)
        return out, dx, res, dy_g

    assert_batch_invariant(run, (x, dy))


def test_all_gradients_repeatable():
    x, weight, table, index, dy = _case(torch.bfloat16)

    def run():
        mod = _grads(lambda a, w, t: rms_norm_modulate(a, w, t[:, :H], t[:, H:2 * H], index, EPS),
                     [x, weight, table], dy)
        gated = _grads(lambda a, t, b: gate_residual(a, t[:, 2 * H:3 * H], b, index), [x, table, mod[0]], dy)
        return (*mod, *gated)

    assert_repeatable(run, runs=100)
