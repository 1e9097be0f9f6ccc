"""gather_rows / scatter_rows: exact copies both ways, on the Triton interpreter and the reference."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flowlock
from flowlock.ops.rows import gather_rows, scatter_rows
from flowlock.testing import (
    assert_batch_invariant,
    assert_bitwise_equal,
    assert_repeatable,
    batch_invariance_failures,
)

BACKENDS = ("triton", "reference")
DTYPES = (torch.bfloat16, torch.float32, torch.float16)


def _gather_eager(x, index):
    return x.index_select(1, index)


def _scatter_eager(parts, indices, seq_len):
    out = parts[0].new_zeros((parts[0].shape[0], seq_len, parts[0].shape[2]))
    for part, index in zip(parts, indices):
        out = out.index_copy(1, index, part)
    return out


def _split(seq_len, sizes, seed):
    perm = torch.randperm(seq_len, generator=torch.Generator().manual_seed(seed))
    out, start = [], 0
    for n in sizes:
        out.append(perm[start:start + n].clone())
        start += n
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,n", [((1, 1, 1), 1), ((2, 7, 33), 5), ((3, 33, 1030), 17)])
def test_gather_forward_backward_are_copies(backend, dtype, shape, n):
    x = torch.randn(shape).to(dtype).requires_grad_()
    index = _split(shape[1], [n], seed=n)[0].to(torch.int32)
    g = torch.randn(shape[0], n, shape[2]).to(dtype)
    with flowlock.use_backend(backend):
        out = gather_rows(x, index)
        (dx,) = torch.autograd.grad(out, x, g)
    assert_bitwise_equal(out, _gather_eager(x.detach(), index), "gather fwd")
    expected = torch.zeros_like(x.detach())
    expected[:, index.long()] = g
    assert_bitwise_equal(dx, expected, "gather bwd")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_matches_index_copy_and_leaves_gaps_zero(backend, dtype):
    seq_len, sizes = 33, (5, 12, 7)  # 9 rows uncovered
    indices = _split(seq_len, sizes, seed=1)
    parts = [torch.randn(2, n, 1030).to(dtype).requires_grad_() for n in sizes]
    grad = torch.randn(2, seq_len, 1030).to(dtype)
    with flowlock.use_backend(backend):
        out = scatter_rows(parts, indices, seq_len)
        grads = torch.autograd.grad(out, parts, grad)
    assert_bitwise_equal(out, _scatter_eager([p.detach() for p in parts], indices, seq_len), "scatter fwd")
    for part_grad, index in zip(grads, indices):
        assert_bitwise_equal(part_grad, grad[:, index], "scatter bwd")


@settings(max_examples=25, deadline=None)
@given(batch=st.integers(1, 3), seq_len=st.integers(1, 40), hidden=st.integers(1, 70),
       frac=st.floats(0.0, 1.0), seed=st.integers(0, 2**16))
def test_round_trip_bitwise_hypothesis(batch, seq_len, hidden, frac, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq_len, hidden, generator=gen).to(torch.bfloat16)
    n = int(frac * seq_len)
    first, second = _split(seq_len, [n, seq_len - n], seed)
    with flowlock.use_backend("triton"):
        a, b = gather_rows(x, first), gather_rows(x, second)
        back = scatter_rows([a, b], [first, second], seq_len)
    assert_bitwise_equal(a, _gather_eager(x, first))
    assert_bitwise_equal(back, x, "gather then scatter of a partition is the identity")


def test_batch_invariant_and_harness_catches_a_planted_gather():
    pool = torch.randn(16, 9, 40).to(torch.bfloat16)
    index = torch.tensor([8, 0, 3, 5])

    def strict(x):
        with flowlock.use_backend("triton"):
            return gather_rows(x, index)

    def planted(x):
        # Takes a different rounding path only when batched: what the harness must see.
        out = gather_rows(x, index)
        return (out.float() * 1.01).to(torch.bfloat16) if x.shape[0] > 1 else out

    assert_batch_invariant(strict, pool, sizes=(2, 3, 7, 16))
    assert batch_invariance_failures(planted, pool, sizes=(2, 3))


def test_gradients_repeatable():
    x = torch.randn(3, 33, 70).to(torch.bfloat16).requires_grad_()
    index = _split(33, [20], seed=3)[0]
    g = torch.randn(3, 20, 70).to(torch.bfloat16)

    def run():
        with flowlock.use_backend("triton"):
            return torch.autograd.grad(gather_rows(x, index), x, g)

    assert_repeatable(run, runs=5)


def test_compiled_equals_eager():
    """torch.compile sees each copy as one opaque custom op: same outputs and gradients as eager."""
    x = torch.randn(2, 9, 40).to(torch.bfloat16).requires_grad_()
    extra = torch.randn(2, 2, 40).to(torch.bfloat16).requires_grad_()
    index, rest = torch.tensor([8, 0, 3, 5]), torch.tensor([1, 7])

    def fn(x, extra):
        with flowlock.use_backend("triton"):
            picked = gather_rows(x, index, check_indices=False)
            return scatter_rows([picked, extra], [index, rest], 9, check_indices=False)

    def run(f):
        out = f(x, extra)
        return (out, *torch.autograd.grad(out, (x, extra), torch.ones_like(out)))

    eager = run(fn)
    compiled = run(torch.compile(fn, backend="aot_eager", fullgraph=True))
    assert_bitwise_equal(compiled, eager, "compiled vs eager")


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_rows(backend):
    x = torch.randn(2, 5, 8)
    with flowlock.use_backend(backend):
        assert gather_rows(x, torch.empty(0, dtype=torch.long)).shape == (2, 0, 8)
        out = scatter_rows([x[:, :0]], [torch.empty(0, dtype=torch.long)], 4)
    assert_bitwise_equal(out, torch.zeros(2, 4, 8))


def _bad_gather_cases():
    x = torch.randn(2, 7, 8)
    ok = torch.tensor([0, 3])
    return [
        ("int x", (x.long(), ok), TypeError, "x"),
        ("2-D x", (x[0], ok), ValueError, "x"),
        ("strided x", (x.transpose(1, 2), ok), ValueError, "x"),
        ("float index", (x, ok.float()), TypeError, "index"),
        ("2-D index", (x, ok[None]), ValueError, "index"),
        ("index too large", (x, torch.tensor([0, 7])), ValueError, "index"),
        ("negative index", (x, torch.tensor([-1, 2])), ValueError, "index"),
        ("repeated index", (x, torch.tensor([2, 2])), ValueError, "unique"),
        ("index on meta", (x, ok.to("meta")), ValueError, "index"),
    ]


@pytest.mark.parametrize("case", _bad_gather_cases(), ids=lambda c: c[0])
def test_gather_bad_inputs_raise_before_launch(case):
    _, args, error, word = case
    before = [a.clone() if a.device.type != "meta" else a for a in args]
    with flowlock.use_backend("triton"), flowlock.mode("strict") as frame, pytest.raises(error, match=word):
        gather_rows(*args)
    assert frame.ran == []
    for a, b in zip(args, before):
        if a.device.type != "meta":
            assert_bitwise_equal(a, b)


def _bad_scatter_cases():
    a, b = torch.randn(2, 2, 8), torch.randn(2, 3, 8)
    ia, ib = torch.tensor([0, 1]), torch.tensor([2, 3, 4])
    return [
        ("no parts", ([], [], 5), TypeError, "parts"),
        ("index count", ([a, b], [ia], 5), TypeError, "indices"),
        ("dtype mix", ([a, b.bfloat16()], [ia, ib], 5), TypeError, "parts"),
        ("hidden mix", ([a, torch.randn(2, 3, 9)], [ia, ib], 5), ValueError, "parts"),
        ("batch mix", ([a, torch.randn(1, 3, 8)], [ia, ib], 5), ValueError, "parts"),
        ("length mismatch", ([a, b], [ia, ib[:2]], 5), ValueError, "indices"),
        ("out of range", ([a, b], [ia, ib], 4), ValueError, "indices"),
        ("overlap", ([a, b], [ia, torch.tensor([1, 3, 4])], 5), ValueError, "unique"),
        ("bad seq_len", ([a, b], [ia, ib], -1), ValueError, "seq_len"),
    ]


@pytest.mark.parametrize("case", _bad_scatter_cases(), ids=lambda c: c[0])
def test_scatter_bad_inputs_raise_before_launch(case):
    _, (parts, indices, seq_len), error, word = case
    before = [t.clone() for t in (*parts, *indices)]
    with flowlock.use_backend("triton"), flowlock.mode("strict") as frame, pytest.raises(error, match=word):
        scatter_rows(parts, indices, seq_len)
    assert frame.ran == []
    for t, ref in zip((*parts, *indices), before):
        assert_bitwise_equal(t, ref)
