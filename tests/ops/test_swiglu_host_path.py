"""swiglu host path: a call that needs no graph skips the autograd Function with the same bits."""

import pytest
import torch

import flowlock
from flowlock.ops.swiglu import swiglu


@pytest.mark.parametrize("shape", [(1, 2), (2, 7, 66)])
def test_no_graph_output_equals_graph_output(shape):
    h = (torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * 3).to(torch.bfloat16)
    with flowlock.use_backend("triton"):
        with torch.no_grad():
            fast = swiglu(h)
        graph = swiglu(h.detach().clone().requires_grad_(True))
    assert fast.grad_fn is None and graph.grad_fn is not None
    assert torch.equal(fast, graph.detach())
