"""gate_residual host path: calls that need no graph skip the autograd Function with the same bits, and
the backward's one launch (d_y and the d_gate partials) has the bits of the two launches it replaced."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flowlock
from flowlock.ops.gate_residual import gate_residual
from flowlock.ops.gate_residual import triton as gt
from flowlock.ops.segment_sum import fold as fold_module
from flowlock.ops.segment_sum.triton import segment_sum_fwd
from flowlock.testing import assert_bitwise_equal

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _case(lead, s, h, r, dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    residual = (torch.randn(*lead, s, h, generator=g) * 4).to(dtype)
    y = torch.randn(*lead, s, h, generator=g).to(dtype)
    table = (0.5 * torch.randn(r, 6 * h, generator=g)).to(dtype).float()
    index = torch.randint(0, r, (s,), generator=g)
    dout = torch.randn(*lead, s, h, generator=g).to(dtype)
    return (t.to(device) for t in (residual, y, table, index, dout))


@pytest.mark.parametrize("lead,s,h", [((), 1, 24), ((2,), 7, 40), ((3,), 33, 24)])
def test_no_graph_output_equals_graph_output(lead, s, h):
    residual, y, table, index, _ = _case(lead, s, h, 3, torch.bfloat16)
    gate = table[:, 2 * h:3 * h]
    with flowlock.use_backend("triton"):
        with torch.no_grad():
            fast = gate_residual(residual, gate, y, index)
        graph = gate_residual(residual, gate, y.detach().clone().requires_grad_(True), index)
    assert fast.grad_fn is None and graph.grad_fn is not None
    assert torch.equal(fast, graph.detach())


def _one_launch_equals_two(lead, s, h, r, dtype, seed, device):
    residual, y, table, index, dout = _case(lead, s, h, r, dtype, seed, device)
    gate = table[:, 2 * h:3 * h]
    with flowlock.use_backend("triton"):
        dy, dgate = gt.gate_residual_bwd(dout, gate, y, index)
        old_dgate = segment_sum_fwd(dout.reshape(-1, h), index, r, other=y.reshape(-1, h), period=s)
    # d_y as the separate launch computed it: eager's product backward, one rounding to the model dtype.
    old_dy = dout * gate.to(dtype)[index]
    assert_bitwise_equal((dy, dgate), (old_dy, old_dgate), "(d_y, d_gate)")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lead,s,h,r", [((), 1, 24, 1), ((2,), 33, 40, 3), ((3,), 70, 24, 9)])
def test_backward_equals_separate_launches(lead, s, h, r, device):
    _one_launch_equals_two(lead, s, h, r, torch.bfloat16, 0, device)


@settings(max_examples=8, deadline=None)
@given(lead=st.sampled_from([(), (2,)]), s=st.sampled_from([1, 7, 33]), h=st.sampled_from([8, 24, 40]),
       r=st.integers(1, 5), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       seed=st.integers(0, 2**16))
def test_backward_equals_separate_launches_hypothesis(lead, s, h, r, dtype, seed):
    _one_launch_equals_two(lead, s, h, r, dtype, seed, "cpu")


def test_backward_is_one_launch_then_the_fold(monkeypatch):
    log = []

    class Counted:
        def __init__(self, kernel, name):
            self.kernel, self.name = kernel, name

        def __getitem__(self, grid):
            log.append(self.name)
            return self.kernel[grid]

    for module, name in ((gt, "_gate_residual_bwd_kernel"), (fold_module, "_fold_groups_kernel")):
        monkeypatch.setattr(module, name, Counted(getattr(module, name), name))
    residual, y, table, index, dout = _case((2,), 33, 24, 3, torch.bfloat16)
    leaves = [t.detach().clone().requires_grad_(True) for t in (residual, y, table)]
    with flowlock.use_backend("triton"):
        out = gate_residual(leaves[0], leaves[2][:, 2 * 24:3 * 24], leaves[1], index)
        out.backward(dout)
    # 66 rows: 2 tiles of 64, folded in one level (interpreter GROUP = 4).
    assert log == ["_gate_residual_bwd_kernel", "_fold_groups_kernel"]
