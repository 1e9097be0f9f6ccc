"""The micro-batch gradient tree (:mod:`flowlock.parallel.sample_tree`), one process, no collectives."""

import pytest
import torch
from torch import nn

from flowlock.parallel import MicroBatchGradients, tree_sum


def _leaves(n: int, shape=(64,), dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(n)
    return [(torch.randn(shape, generator=gen) * 10.0 ** torch.randint(-3, 4, (1,), generator=gen)).to(dtype)
            for _ in range(n)]


def test_tree_sum_is_the_pairwise_tree_split_at_the_largest_power_of_two():
    a, b, c, d, e, f, g = (x.float() for x in _leaves(7))
    assert torch.equal(tree_sum([a]), a)
    assert torch.equal(tree_sum([a, b, c]), (a + b) + c)
    assert torch.equal(tree_sum([a, b, c, d, e, f, g]), ((a + b) + (c + d)) + ((e + f) + g))
    assert tree_sum([a.bfloat16()]).dtype == torch.float32


def test_tree_sum_differs_from_a_running_sum():
    # the check below is only meaningful if the two orders round differently on these leaves
    parts = [x.float() for x in _leaves(8, shape=(4096,))]
    running = parts[0].clone()
    for p in parts[1:]:
        running += p
    assert not torch.equal(tree_sum(parts), running)


@pytest.mark.parametrize("count", [1, 2, 3, 5, 8, 9])
def test_micro_batch_gradients_fold_in_the_tree_and_round_once(count):
    layer = nn.Linear(16, 8, dtype=torch.bfloat16)
    grads = []
    tree = MicroBatchGradients(layer.parameters())
    for i, x in enumerate(_leaves(count, shape=(3, 16))):
        layer(x).float().pow(2).sum().mul(i + 1).backward()
        grads.append([p.grad.clone() for p in layer.parameters()])
        tree.add()
        assert all(p.grad is None for p in layer.parameters())
    expected = [tree_sum([g[j] for g in grads]) for j in range(2)]
    assert all(torch.equal(t, e) for t, e in zip(tree.total(), expected))
    tree.write_()
    assert [p.grad.dtype for p in layer.parameters()] == [torch.bfloat16] * 2
    assert all(torch.equal(p.grad, e.bfloat16()) for p, e in zip(layer.parameters(), expected))
    assert tree.count == 0


def test_a_parameter_without_gradient_in_some_micro_batches_sums_the_others():
    a, b = nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(4))
    tree = MicroBatchGradients([a, b])
    for step in range(3):
        (a * (step + 1.5)).sum().backward()
        if step == 1:
            (b * 0.25).sum().backward()
        tree.add()
    tree.write_()
    assert torch.equal(a.grad, torch.full((4,), 1.5 + 2.5 + 3.5))
    assert torch.equal(b.grad, torch.full((4,), 0.25))


@pytest.mark.parametrize(("degree", "dtype", "message"), [
    (3, torch.float32, "power-of-two degree"),
    (2, torch.bfloat16, "keep fp32 master parameters"),
])
def test_a_fold_that_could_not_be_one_process_is_refused_at_the_second_micro_batch(degree, dtype, message):
    weight = nn.Parameter(torch.ones(4, dtype=dtype))
    tree = MicroBatchGradients([weight], data_parallel_size=degree)
    weight.sum().backward()
    tree.add()
    weight.sum().backward()
    with pytest.raises(ValueError, match=message):
        tree.add()
    assert weight.grad is not None
