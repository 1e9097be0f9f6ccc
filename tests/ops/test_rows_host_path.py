"""gather_rows / scatter_rows host path: calls that need no graph skip the autograd Functions with the
same bits."""

import torch

import flowlock
from flowlock.ops.rows import gather_rows, scatter_rows


def test_no_graph_outputs_equal_graph_outputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 9, 24, generator=g).to(torch.bfloat16)
    index = torch.tensor([7, 0, 3, 8])
    parts = [torch.randn(2, n, 24, generator=g).to(torch.bfloat16) for n in (3, 2)]
    indices = [torch.tensor([1, 5, 2]), torch.tensor([8, 0])]
    with flowlock.use_backend("triton"):
        with torch.no_grad():
            gathered, scattered = gather_rows(x, index), scatter_rows(parts, indices, 9)
        gathered_graph = gather_rows(x.detach().clone().requires_grad_(True), index)
        scattered_graph = scatter_rows([parts[0].detach().clone().requires_grad_(True), parts[1]], indices, 9)
    assert gathered.grad_fn is None and scattered.grad_fn is None
    assert gathered_graph.grad_fn is not None and scattered_graph.grad_fn is not None
    assert torch.equal(gathered, gathered_graph.detach()) and torch.equal(scattered, scattered_graph.detach())
