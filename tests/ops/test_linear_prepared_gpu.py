"""linear's prepared launches of the Triton TMA kernel on a Hopper GPU: a relaunch (tensor maps encoded
once per address) gives the bits of Triton's own launch, for new tensors at new addresses too, and is
what runs.

    TRITON_INTERPRET=0 python -m pytest -q -m gpu tests/ops/test_linear_prepared_gpu.py
"""

import pytest
import torch

from flowlock.ops._launch import PlanTable
from flowlock.ops.linear import triton as lt

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                       reason="needs a Hopper (sm90+) GPU"),
]


# (N, K, x's row stride): a small layer (forward 48 tiles, fewer than the SMs), and one whose bf16
# forward and dX at M = 925 are 224 and 168 tiles (more than the SMs; the dX tail split).
SIZES = {"small": (1536, 512, 640), "q": (7168, 5376, 5504)}


def _operands(dtype, bias, seed, size="small", m=925):
    n, k, row_stride = SIZES[size]
    g = torch.Generator(device="cuda").manual_seed(seed)
    # x is a column slice of a wider buffer: a row stride that is not its width.
    x = torch.randn(m, row_stride, generator=g, device="cuda").to(dtype)[:, :k]
    w = (torch.randn(n, k, generator=g, device="cuda") / k**0.5).to(dtype)
    b = torch.randn(n, generator=g, device="cuda").to(dtype) if bias else None
    dy = torch.randn(m, n, generator=g, device="cuda").to(dtype)
    return x, w, b, dy


def _tma(op, w, *operands):
    """The frozen config on the Triton TMA kernel (the bf16 forward and dX run on the Gluon one, whose
    prepared launches test_linear_gluon_gpu.py covers)."""
    return lt.lookup(op, w, *operands).with_blocks(GLUON=0)


def _products(x, w, b, dy):
    return (lt.linear_fwd(x, w, b, x.dtype, config=_tma("linear_fwd", w, x, w)),
            lt.linear_dx(dy, w, x.dtype, config=_tma("linear_dx", w, dy, w)), lt.linear_dw(dy, x, w, w.dtype))


def _through_triton(x, w, b, dy):
    """Each product through Triton's launch: the plan table is emptied before each."""
    out = []
    for product in (lambda: lt.linear_fwd(x, w, b, x.dtype, config=_tma("linear_fwd", w, x, w)),
                    lambda: lt.linear_dx(dy, w, x.dtype, config=_tma("linear_dx", w, dy, w)),
                    lambda: lt.linear_dw(dy, x, w, w.dtype)):
        lt._TMA_PLANS.clear()
        out.append(product())
    return out


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [True, False])
def test_relaunch_keeps_the_bits_of_tritons_launch(dtype, bias, size, monkeypatch):
    first = _operands(dtype, bias, seed=0, size=size)
    expected = _through_triton(*first)
    assert len(lt._TMA_PLANS) == 1
    lt._TMA_PLANS.clear()
    _products(*first)
    assert len(lt._TMA_PLANS) == 3
    relaunches = []
    for key, (launch, programs, stream_k) in list(lt._TMA_PLANS.items()):
        def counted(*args, _launch=launch):
            relaunches.append(args[0])
            return _launch(*args)
        lt._TMA_PLANS[key] = (counted, programs, stream_k)
    again = _products(*first)
    # New tensors at new addresses (the old ones still alive), then the old weight with new activations.
    second = _operands(dtype, bias, seed=1, size=size)
    fresh = _products(*second)
    mixed = (second[0], first[1], first[2], second[3])
    reused = _products(*mixed)
    assert len(relaunches) == 9
    monkeypatch.setattr(lt, "_TMA_PLANS", PlanTable(lt._TMA_PLANS.limit))
    for got, want in ((again, expected), (fresh, _through_triton(*second)), (reused, _through_triton(*mixed))):
        for g, w in zip(got, want):
            assert torch.equal(g, w)


def test_stream_k_relaunch_takes_a_fresh_workspace():
    """A prepared STREAM_K launch (the sweep candidate) gets a zeroed ticket and turn flags on every
    relaunch: reused ones would hand out tickets past the last program."""
    x, w, _, dy = _operands(torch.bfloat16, False, seed=2, size="q")
    cfg = _tma("linear_dx", w, dy, w).with_blocks(STREAM_K=1)
    lt._TMA_PLANS.clear()
    first = lt.linear_dx(dy, w, torch.bfloat16, config=cfg)
    assert [plan[2] for plan in lt._TMA_PLANS.values()] == [True], "one plan, stream-K"
    for _ in range(3):
        assert torch.equal(lt.linear_dx(dy, w, torch.bfloat16, config=cfg), first)
    assert torch.equal(first, lt.linear_dx(dy, w, torch.bfloat16))
