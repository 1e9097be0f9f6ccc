"""linear host path: a call that needs no graph skips the autograd Function with the same bits, and the
API's one config lookup is the frozen config the launchers would pick."""

import pytest
import torch

import flowlock
from flowlock.config import launch_config
from flowlock.ops.linear import linear
from flowlock.ops.linear import triton as lt


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("lead,n,k,bias", [((1,), 24, 40, True), ((2, 7), 40, 24, False)])
def test_no_graph_output_equals_graph_output(lead, n, k, bias, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*lead, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    with flowlock.use_backend("triton"):
        with torch.no_grad():
            fast = linear(x, w, b)
        graph = linear(x, w.detach().clone().requires_grad_(True), b)
    assert fast.grad_fn is None and graph.grad_fn is not None
    assert torch.equal(fast, graph.detach())


def test_memoized_lookup_is_the_frozen_config():
    w = torch.empty(40, 24, dtype=torch.bfloat16)
    for op in ("linear_fwd", "linear_dx", "linear_dw"):
        assert lt.lookup(op, w, w, w) is launch_config(op, torch.bfloat16, "interp", (40, 24))
    assert lt.lookup("linear_fwd", w, w.float(), w) is launch_config("linear_fwd", torch.float32, "interp", (40, 24))
