"""final_adaln_out: rows and dx batch-invariant (harness shown to catch a planted split), every
gradient repeatable."""

import torch
from final_adaln_cases import final_adaln_inputs

import flowlock
from flowlock.ops.adaln.triton import AdalnTableFunction
from flowlock.ops.final_adaln import final_adaln_out
from flowlock.testing import assert_batch_invariant, assert_repeatable, batch_invariance_failures

EPS = 1e-6


def _inputs(b, s, t, e, h, seed=0):
    # Large activations, so a batch-dependent reduction order would show in the bits.
    return final_adaln_inputs(b, s, t, e, h, seed, x_scale=30.0)


def _final(x, temb, nw, w, b, ti):
    with flowlock.use_backend("triton"):
        return final_adaln_out(x, temb, nw, w, b, ti, EPS)


def _planted(x, temb, nw, w, b, ti):
    """Planted defect: the mean of squares is summed in two BF16-rounded parts split at a point that
    depends on the batch size."""
    with flowlock.use_backend("triton"):
        table = AdalnTableFunction.apply(temb, w, b)
    h = x.shape[-1]
    sq = x.float().pow(2)
    k = 1 + x.shape[0] % 5
    parts = [p.sum(-1, keepdim=True).to(torch.bfloat16).float() for p in (sq[..., :k], sq[..., k:])]
    n = (x.float() * torch.rsqrt((parts[0] + parts[1]) / h + EPS) * nw.float()).to(torch.bfloat16)
    scale, shift = table[ti, h:].to(torch.bfloat16), table[ti, :h].to(torch.bfloat16)
    return n * (1.0 + scale) + shift


def _forward(fn, shared):
    return lambda x: fn(x, *shared)


def _with_dx(fn, shared):
    def run(x, dy):
        leaf = x.clone().requires_grad_(True)
        y = fn(leaf, *shared)
        y.backward(dy)
        return y.detach(), leaf.grad
    return run


def test_rows_batch_invariant_and_harness_catches_planted_split():
    x, temb, nw, w, b, ti = _inputs(16, 7, 2, 20, 24, seed=5)
    shared = (temb, nw, w, b, ti)
    assert_batch_invariant(_forward(_final, shared), x)
    assert batch_invariance_failures(_forward(_planted, shared), x), "harness missed a planted split"


def test_dx_batch_invariant():
    # The backward is costly under the interpreter: a smaller pool, still alone vs 2, 3 and 4.
    x, temb, nw, w, b, ti = _inputs(4, 7, 2, 20, 24, seed=6)
    dy = torch.randn(4, 7, 24, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    assert_batch_invariant(_with_dx(_final, (temb, nw, w, b, ti)), (x, dy), sizes=(2, 3, 4))


def test_all_gradients_repeatable():
    args = _inputs(2, 33, 3, 20, 24, seed=12)
    upstream = torch.randn(2, 33, 24, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)

    def grads():
        leaves = [a.clone().requires_grad_(True) for a in args[:5]]
        _final(*leaves, args[5]).backward(upstream)
        return [a.grad for a in leaves]
    assert_repeatable(grads, runs=20)
