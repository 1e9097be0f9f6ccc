import torch

from flowlock.ops._graph import needs_graph


def test_needs_graph_follows_grad_mode_and_requires_grad():
    a = torch.zeros(2, requires_grad=True)
    b = torch.zeros(2)
    assert needs_graph(a, b)
    assert needs_graph(None, a)
    assert not needs_graph(b, None)
    assert not needs_graph()
    with torch.no_grad():
        assert not needs_graph(a, b)
    with torch.inference_mode():
        assert not needs_graph(b)
