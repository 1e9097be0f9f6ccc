"""qk_norm_rope host path: a call that needs no graph skips the autograd Function with the same bits."""

import pytest
import torch

import flowlock
from flowlock.ops.qk_norm_rope import qk_norm_rope


@pytest.mark.parametrize("b,s,heads,d,r", [(1, 1, 1, 8, 2), (2, 7, 3, 24, 16)])
def test_no_graph_output_equals_graph_output(b, s, heads, d, r):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(b, s, heads, d, generator=g).to(torch.bfloat16)
    w = (1 + 0.3 * torch.randn(d, generator=g)).to(torch.bfloat16)
    angles = torch.randn(s, r, generator=g)
    cos, sin = angles.cos(), angles.sin()
    with flowlock.use_backend("triton"):
        with torch.no_grad():
            fast = qk_norm_rope(x, w, cos, sin, 1e-6)
        graph = qk_norm_rope(x.detach().clone().requires_grad_(True), w, cos, sin, 1e-6)
    assert fast.grad_fn is None and graph.grad_fn is not None
    assert torch.equal(fast, graph.detach())
