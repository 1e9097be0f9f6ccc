"""timestep_mlp and timestep_sinusoid host paths: the no-graph call gives the graph call's bits, the
MLP is two launches each way, weight gradients do not depend on whether dx is wanted, and every
output and gradient is at least as close to the FP64 golden as eager float32 PyTorch."""

import pytest
import torch
import torch.nn.functional as F
import triton.runtime.interpreter as interpreter

import flowlock
from flowlock.ops.timestep import timestep_mlp, timestep_sinusoid
from flowlock.ops.timestep import triton as timestep_triton
from flowlock.ops.timestep.reference import timestep_mlp_golden, timestep_mlp_reference
from flowlock.testing import assert_bitwise_equal

K, HIDDEN, EMBED = 256, 75, 33
NAMES = ("out", "dx", "dw1", "db1", "dw2", "db2")


def _params(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(HIDDEN, K, generator=g) / 16, torch.randn(HIDDEN, generator=g),
            torch.randn(EMBED, HIDDEN, generator=g) / HIDDEN ** 0.5, torch.randn(EMBED, generator=g)]


def _x(rows, seed):
    with flowlock.use_backend("triton"):
        return timestep_sinusoid(torch.rand(rows, generator=torch.Generator().manual_seed(seed)))


def _grads(fn, x, params, grad, x_grad=True):
    leaves = [x.clone().requires_grad_(x_grad)] + [p.clone().requires_grad_() for p in params]
    out = fn(*leaves)
    out.backward(grad.to(out.dtype))
    return [out.detach()] + [leaf.grad for leaf in leaves]


def _eager(x, w1, b1, w2, b2):
    return F.linear(F.silu(F.linear(x, w1, b1)), w2, b2)


def _mlp(*args):
    with flowlock.use_backend("triton"):
        return timestep_mlp(*args)


@pytest.mark.parametrize("rows", [1, 3, 6])
def test_mlp_no_graph_path_gives_the_graph_paths_bits(rows):
    params, x = _params(rows), _x(rows, 1)
    with torch.no_grad():
        plain = _mlp(x, *params)
    graph = _mlp(x.clone().requires_grad_(), *params)
    assert graph.grad_fn is not None and plain.grad_fn is None
    assert torch.equal(plain, graph.detach())


def test_sinusoid_no_graph_path_gives_the_graph_paths_bits():
    t = torch.rand(7, generator=torch.Generator().manual_seed(2))
    with flowlock.use_backend("triton"):
        plain = timestep_sinusoid(t)
        graph = timestep_sinusoid(t.clone().requires_grad_())
    assert graph.grad_fn is not None and plain.grad_fn is None
    assert torch.equal(plain, graph.detach())


@pytest.fixture
def launches(monkeypatch):
    """Counts Triton launches (interpreted kernels are indexed by their grid once per launch)."""
    count = [0]
    real = interpreter.InterpretedFunction.__getitem__

    def counting(self, grid):
        count[0] += 1
        return real(self, grid)

    monkeypatch.setattr(interpreter.InterpretedFunction, "__getitem__", counting)
    return count


@pytest.mark.parametrize("x_grad", [True, False])
def test_mlp_is_two_launches_forward_and_two_backward(launches, x_grad):
    params, x = _params(3), _x(3, 4)
    leaves = [x.clone().requires_grad_(x_grad)] + [p.clone().requires_grad_() for p in params]
    launches[0] = 0
    out = _mlp(*leaves)
    assert launches[0] == 2
    launches[0] = 0
    out.backward(torch.ones_like(out))
    assert launches[0] == 2
    assert (leaves[0].grad is not None) == x_grad


def test_mlp_weight_grads_do_not_depend_on_whether_dx_is_wanted():
    """Without dx the second backward launch runs only the weight-gradient programs; their bits are
    the same as when the dx programs share the launch."""
    params, x = _params(5), _x(5, 6)
    grad = torch.randn(5, EMBED, generator=torch.Generator().manual_seed(7))
    with_dx = _grads(_mlp, x, params, grad)
    without_dx = _grads(_mlp, x, params, grad, x_grad=False)
    assert without_dx[1] is None
    assert_bitwise_equal(with_dx[:1] + with_dx[2:], without_dx[:1] + without_dx[2:])


def _rel_error(got, gold):
    return ((got.double() - gold).abs().max() / gold.abs().max()).item()


def test_mlp_every_output_and_grad_at_least_as_accurate_as_eager_fp32():
    """T = 3, seeded: each GEMV accumulates in float64 and rounds once, so out, dx, dw1, db1, dw2 and db2
    are each at least as close to the FP64 golden (max|g - g64| / max|g64|) as eager float32 PyTorch
    (dw1 was not, on the H200, with float32 sums: 2.1e-7 vs diffusers' 1.7e-7), and the values that
    are one rounding of a float64 sum of stored values are the golden's own, rounded."""
    params, x = _params(8), _x(3, 9)
    grad = torch.randn(3, EMBED, generator=torch.Generator().manual_seed(10))
    ours = _grads(_mlp, x, params, grad)
    eager = _grads(_eager, x, params, grad)
    gold = _grads(timestep_mlp_golden, x.double(), [p.double() for p in params], grad)
    for name, a, b, g in zip(NAMES, ours, eager, gold):
        assert a.dtype == torch.float32 and a.shape == g.shape, name
        assert _rel_error(a, g) <= _rel_error(b, g), (name, _rel_error(a, g), _rel_error(b, g))
    # One rounding per stored value: the forward (h, SiLU, out) and linear_2's weight and bias
    # gradients (sums of exact products of stored values) are the golden's float64 values rounded
    # to float32; float32 accumulation would miss many of them.
    for name in ("out", "dw2", "db2"):
        i = NAMES.index(name)
        assert_bitwise_equal(ours[i], gold[i].float(), name)
    assert_bitwise_equal(ours[0], timestep_mlp_reference(x, *params))


@pytest.mark.gpu
def test_mlp_grads_at_least_as_accurate_as_diffusers_on_cuda_at_h3_dims(monkeypatch):
    """The issue's bar at H3 sizes, T = 3: every output and gradient at least as close to the FP64
    golden as eager float32 (cuBLAS, what diffusers runs)."""
    g = torch.Generator().manual_seed(19)
    params = [p.cuda() for p in (torch.randn(5376, 256, generator=g) / 16, torch.randn(5376, generator=g),
                                 torch.randn(2688, 5376, generator=g) / 73, torch.randn(2688, generator=g))]
    x = timestep_sinusoid(torch.rand(3, generator=g).cuda())
    grad = torch.randn(3, 2688, generator=g).cuda()
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    ours = _grads(timestep_mlp, x, params, grad)
    eager = _grads(_eager, x, params, grad)
    gold = _grads(timestep_mlp_golden, x.double(), [p.double() for p in params], grad)
    for name, a, b, gd in zip(NAMES, ours, eager, gold):
        assert _rel_error(a, gd) <= _rel_error(b, gd), (name, _rel_error(a, gd), _rel_error(b, gd))


@pytest.mark.gpu
def test_mlp_prepared_launches_give_the_first_calls_bits_and_misaligned_inputs_skip_them(monkeypatch):
    """The first call per layer sizes launches through Triton and keeps both launches; later calls
    with 16-byte-aligned inputs relaunch them (same bits), a misaligned input takes the full path."""
    monkeypatch.setattr(timestep_triton, "_FWD_PLANS", {})
    g = torch.Generator().manual_seed(23)
    params = [p.cuda() for p in _params(23)]
    x = torch.randn(3, K, generator=g).cuda()
    first = timestep_mlp(x, *params)
    (key, plan), = timestep_triton._FWD_PLANS.items()
    used = []

    def counting(prepared):
        def call(*args):
            used.append(args[0])
            prepared(*args)
        return call

    timestep_triton._FWD_PLANS[key] = (counting(plan[0]), plan[1], counting(plan[2]), plan[3])
    again = timestep_mlp(x, *params)
    assert used == [plan[1] * 3, plan[3] * 3]
    buf = torch.empty(3 * K + 1, device="cuda")
    misaligned = buf[1:].view(3, K)
    misaligned.copy_(x)
    assert misaligned.data_ptr() % 16
    off = timestep_mlp(misaligned, *params)
    assert len(used) == 2
    assert_bitwise_equal([again, off], [first, first])


@pytest.mark.gpu
def test_mlp_programmatic_dependent_launch_gives_the_plain_launches_bits():
    """linear_2 starts streaming its weights before linear_1 finishes and waits for it before reading
    the activations: at H3 sizes, alternating inputs (so a missed wait would read the other input's
    activations), every call equals two plain launches of the same tiles."""
    g = torch.Generator().manual_seed(29)
    params = [p.cuda() for p in (torch.randn(5376, 256, generator=g) / 16, torch.randn(5376, generator=g),
                                 torch.randn(2688, 5376, generator=g) / 73, torch.randn(2688, generator=g))]
    xs = [torch.randn(3, 256, generator=g).cuda() for _ in range(2)]
    device = xs[0].device
    second = timestep_triton._mlp_fwd_args(device, False, 2688, 5376, 0)
    assert second["launch_pdl"] and second["PDL"]

    def plain(x):
        w1, b1, w2, b2 = params
        h, act, out = torch.empty(3, 5376, device=device), torch.empty(3, 5376, device=device), torch.empty(
            3, 2688, device=device)
        for args, n, k, epilogue in (((x, w1, b1, h, act), 5376, 256, 1), ((act, w2, b2, None, out), 2688, 5376, 0)):
            kwargs = dict(timestep_triton._mlp_fwd_args(device, False, n, k, epilogue), PDL=False, launch_pdl=False)
            timestep_triton._timestep_mlp_fwd_kernel[(-(-n // kwargs["BLOCK_N"]) * 3,)](*args, n, k, **kwargs)
        return out, h, act

    expected = [plain(x) for x in xs]
    for i in range(20):
        assert_bitwise_equal(list(timestep_triton.timestep_mlp_fwd(xs[i % 2], *params)), list(expected[i % 2]))
