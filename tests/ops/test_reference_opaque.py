"""The reference backend's opaque custom ops (``flowlock.ops.<family>.opaque``): each passes
``torch.library.opcheck`` (schema, fake shapes, autograd registration) and gives the spec's eager
bits, forward and every gradient; under tracing the public op records its ``flowlock::*_reference``
node and nothing of the spec's arithmetic."""

import itertools

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

from flowlock.ops import (
    adaln_modulation,
    adaln_table,
    attention,
    euler_step,
    final_adaln_out,
    gate_residual,
    gather_rows,
    linear,
    qk_norm_rope,
    rms_norm,
    rms_norm_modulate,
    scatter_rows,
    segment_sum,
    swiglu,
    timestep_mlp,
    timestep_sinusoid,
)
from flowlock.ops.adaln.opaque import adaln_modulation_reference_op, adaln_table_reference_op
from flowlock.ops.adaln.reference import adaln_modulation_reference, adaln_table_reference
from flowlock.ops.attention.opaque import attention_reference_op
from flowlock.ops.attention.reference import attention_reference
from flowlock.ops.euler.opaque import euler_step_reference_op
from flowlock.ops.euler.reference import euler_step_reference
from flowlock.ops.final_adaln.opaque import final_adaln_out_reference_op
from flowlock.ops.final_adaln.reference import final_adaln_out_reference
from flowlock.ops.gate_residual.opaque import gate_residual_reference_op
from flowlock.ops.gate_residual.reference import gate_residual_reference
from flowlock.ops.linear.opaque import linear_reference_op
from flowlock.ops.linear.reference import linear_reference
from flowlock.ops.qk_norm_rope.opaque import qk_norm_rope_reference_op
from flowlock.ops.qk_norm_rope.reference import qk_norm_rope_reference
from flowlock.ops.rms_norm.opaque import rms_norm_modulate_reference_op, rms_norm_reference_op
from flowlock.ops.rms_norm.reference import rms_norm_modulate_reference, rms_norm_reference
from flowlock.ops.rows.opaque import gather_rows_reference_op, scatter_rows_reference_op
from flowlock.ops.rows.reference import gather_rows_reference, scatter_rows_reference
from flowlock.ops.segment_sum.opaque import segment_sum_reference_op
from flowlock.ops.segment_sum.reference import segment_sum_reference
from flowlock.ops.swiglu.opaque import swiglu_reference_op
from flowlock.ops.swiglu.reference import swiglu_reference
from flowlock.ops.timestep.opaque import timestep_mlp_reference_op, timestep_sinusoid_reference_op
from flowlock.ops.timestep.reference import timestep_mlp_reference, timestep_sinusoid_reference
from flowlock.testing import bitwise_equal

BF16, F32 = torch.bfloat16, torch.float32
S, H, T = 6, 8, 2


_SEEDS = itertools.count(1)


def _r(*shape, dtype=BF16, grad=True):
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(next(_SEEDS))).to(dtype)
    return t.requires_grad_(grad)


def _index(n, upper, seed):
    return torch.randint(0, upper, (n,), generator=torch.Generator().manual_seed(seed))


def _cases():
    """(name, public op, spec, opaque op, args): args valid for the public op and the spec alike."""
    table = _r(3 * T, 6 * H, dtype=F32)
    cos, sin = _r(S, 6, dtype=F32, grad=False), _r(S, 6, dtype=F32, grad=False)
    perm = torch.randperm(S, generator=torch.Generator().manual_seed(3))
    t = torch.tensor([0.25, 0.75])
    return [
        ("linear", lambda *a: linear(*a[:3], out_dtype=a[3]), linear_reference, linear_reference_op,
         (_r(2, S, H), _r(5, H), _r(5), F32)),
        ("attention", lambda q, k, v, s: attention(q, k, v, scale=s), attention_reference, attention_reference_op,
         (_r(1, S, 2, 16), _r(1, S, 2, 16), _r(1, S, 2, 16), 0.25)),
        ("qk_norm_rope", qk_norm_rope, qk_norm_rope_reference, qk_norm_rope_reference_op,
         (_r(1, S, 2, 16), _r(16), cos, sin, 1e-6)),
        ("rms_norm", rms_norm, rms_norm_reference, rms_norm_reference_op, (_r(2, S, H), _r(H), 1e-6)),
        ("rms_norm_modulate", rms_norm_modulate, rms_norm_modulate_reference, rms_norm_modulate_reference_op,
         (_r(2, S, H), _r(H), table[:, :H], table[:, H:2 * H], _index(S, 3 * T, 1), 1e-6)),
        ("gate_residual", gate_residual, gate_residual_reference, gate_residual_reference_op,
         (_r(2, S, H), table[:, 2 * H:3 * H], _r(2, S, H), _index(S, 3 * T, 2))),
        ("adaln_table", adaln_table, adaln_table_reference, adaln_table_reference_op,
         (_r(T, 12, dtype=F32), _r(18 * H, 12), _r(18 * H))),
        ("adaln_modulation", adaln_modulation, adaln_modulation_reference, adaln_modulation_reference_op,
         (_r(T, 12, dtype=F32), _r(18 * H, 12), _r(18 * H), _index(S, T, 4), _index(S, 3, 5))),
        ("final_adaln_out", final_adaln_out, final_adaln_out_reference, final_adaln_out_reference_op,
         (_r(2, S, H), _r(T, 12, dtype=F32), _r(H), _r(2 * H, 12), _r(2 * H), _index(S, T, 6), 1e-6)),
        ("gather_rows", gather_rows, gather_rows_reference, gather_rows_reference_op, (_r(2, S, H), perm[:4])),
        ("scatter_rows", scatter_rows, scatter_rows_reference, scatter_rows_reference_op,
         ([_r(2, 2, H), _r(2, 3, H)], [perm[:2], perm[2:5]], S)),
        ("swiglu", swiglu, swiglu_reference, swiglu_reference_op, (_r(2, S, 2 * H),)),
        ("timestep_sinusoid", timestep_sinusoid, timestep_sinusoid_reference, timestep_sinusoid_reference_op,
         (t.requires_grad_(),)),
        ("timestep_mlp", timestep_mlp, timestep_mlp_reference, timestep_mlp_reference_op,
         (_r(T, 16, dtype=F32), _r(10, 16, dtype=F32), _r(10, dtype=F32), _r(7, 10, dtype=F32),
          _r(7, dtype=F32))),
        ("segment_sum", segment_sum, segment_sum_reference, segment_sum_reference_op,
         (_r(S, H), _index(S, 4, 7), 4)),
        ("euler_step", euler_step, euler_step_reference, euler_step_reference_op,
         (_r(2, S, H), _r(2, S, H), *(torch.tensor([v, v]) for v in (0.4, 0.6, 0.5)))),
    ]


CASES = _cases()
IDS = [c[0] for c in CASES]


def _tensors(args):
    for a in args:
        if isinstance(a, list):
            yield from a
        elif isinstance(a, torch.Tensor):
            yield a


def _outputs_and_grads(fn, args):
    outputs = fn(*args)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    wrt = [t for t in _tensors(args) if t.requires_grad]
    gen = torch.Generator().manual_seed(9)
    cotangents = [torch.randn(o.shape, generator=gen).to(o.dtype) for o in outputs]
    return [o.detach() for o in outputs], list(torch.autograd.grad(outputs, wrt, cotangents))


@pytest.mark.parametrize("name, public, spec, op, args", CASES, ids=IDS)
def test_opaque_op_passes_opcheck(name, public, spec, op, args):
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("name, public, spec, op, args", CASES, ids=IDS)
def test_opaque_op_gives_the_spec_bits_forward_and_backward(name, public, spec, op, args):
    expected, expected_grads = _outputs_and_grads(spec, args)
    actual, grads = _outputs_and_grads(op, args)
    assert all(bitwise_equal(a, e) for a, e in zip(actual, expected, strict=True)), name
    assert len(grads) == len(expected_grads) > 0
    assert all(bitwise_equal(g, e) for g, e in zip(grads, expected_grads, strict=True)), name


# Host read-backs of index and schedule ranges cannot be traced; compiled callers validate once and skip them.
NO_READBACK = {"check_indices": False}
SKIP_CHECKS = {"rms_norm_modulate": NO_READBACK, "gate_residual": NO_READBACK, "adaln_modulation": NO_READBACK,
               "final_adaln_out": NO_READBACK, "gather_rows": NO_READBACK, "scatter_rows": NO_READBACK,
               "segment_sum": NO_READBACK, "timestep_sinusoid": {"check_range": False},
               "euler_step": {"check_schedule": False}}


@pytest.mark.parametrize("name, public, spec, op, args", CASES, ids=IDS)
def test_traced_public_op_records_its_opaque_nodes_only(name, public, spec, op, args):
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    kwargs = SKIP_CHECKS.get(name, {})
    compiled = torch.compile(lambda *a: public(*a, **kwargs), fullgraph=True,
                             backend=aot_autograd(fw_compiler=capture, bw_compiler=capture))
    actual, grads = _outputs_and_grads(compiled, args)
    expected, expected_grads = _outputs_and_grads(spec, args)
    torch._dynamo.reset()
    assert all(bitwise_equal(a, e) for a, e in zip(actual, expected, strict=True))
    assert all(bitwise_equal(g, e) for g, e in zip(grads, expected_grads, strict=True))
    forward, backward = graphs
    calls = [{str(n.target) for n in g.graph.nodes if n.op == "call_function"} for g in graphs]
    assert {t for t in calls[0] if t.startswith("flowlock.")} == {f"flowlock.{name}_reference.default"}
    assert {t for t in calls[1] if t.startswith("flowlock.")} == {f"flowlock.{name}_reference_bwd.default"}
    # Everything else in the graphs only moves or aliases data (the spec's arithmetic is inside the nodes).
    rest = {t for c in calls for t in c if not t.startswith("flowlock.")}
    assert rest <= MOVES_DATA, rest - MOVES_DATA


MOVES_DATA = {"<built-in function getitem>", "aten.view.default", "aten.expand.default", "aten.clone.default",
              "aten.alias.default", "aten.slice.default", "aten.detach.default", "aten._unsafe_view.default"}
