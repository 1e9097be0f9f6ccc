"""gate_residual: bitwise parity with diffusers' eager expression (forward and d_y), FP64 budget for
d_gate, batch invariance, repeatability, bad inputs."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_rms_norm_values import MODES, adversarial

import flowlock
from flowlock.ops.gate_residual import gate_residual
from flowlock.ops.gate_residual.reference import gate_residual_golden
from flowlock.testing import (
    assert_batch_invariant,
    assert_bitwise_equal,
    assert_raise_before_launch,
    assert_repeatable,
    assert_within_budget,
    batch_invariance_failures,
)


def _eager(residual, gate, y, index):
    """MiniMaxH3TransformerBlock's update, on a gate table in the model dtype."""
    return residual + gate.to(residual.dtype).index_select(0, index) * y


def _run(fn, residual, gate, y, index, dout, backend=None):
    leaves = [t.detach().clone().requires_grad_(True) for t in (residual, gate, y)]
    if backend is None:
        out = fn(*leaves, index)
    else:
        with flowlock.use_backend(backend):
            out = fn(*leaves, index)
    out.backward(dout.to(out.dtype))
    return out.detach(), *(t.grad for t in leaves)


def _case(lead, s, h, r, dtype, seed=0, fp32_table=True):
    g = torch.Generator().manual_seed(seed)
    residual = (torch.randn(*lead, s, h, generator=g) * 4).to(dtype)
    y = torch.randn(*lead, s, h, generator=g).to(dtype)
    table = (0.5 * torch.randn(r, 6 * h, generator=g)).to(dtype)
    table = table.float() if fp32_table else table
    index = torch.randint(0, r, (s,), generator=g)
    dout = torch.randn(*lead, s, h, generator=g).to(dtype)
    return residual, table, y, index, dout


@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
       modes=st.tuples(*[st.sampled_from(MODES)] * 4), s=st.sampled_from([1, 7, 33]), h=st.sampled_from([24, 40]),
       lead=st.sampled_from([(), (2,)]), fp32_table=st.booleans(), backend=st.sampled_from(["triton", "reference"]),
       seed=st.integers(0, 2**16))
def test_forward_and_dy_bitwise_equal_to_eager(dtype, modes, s, h, lead, fp32_table, backend, seed):
    gen = torch.Generator().manual_seed(seed)
    residual = adversarial((*lead, s, h), dtype, modes[0], gen)
    table = adversarial((3, 6 * h), dtype, modes[1], gen)
    table = table.float() if fp32_table else table
    gate = table[:, 2 * h:3 * h]
    y = adversarial((*lead, s, h), dtype, modes[2], gen)
    dout = adversarial((*lead, s, h), dtype, modes[3], gen)
    index = torch.randint(0, 3, (s,), generator=gen, dtype=torch.int32 if seed % 2 else torch.int64)
    out, d_res, _, d_y = _run(gate_residual, residual, gate, y, index, dout, backend)
    want, want_res, _, want_y = _run(_eager, residual, gate, y, index.long(), dout)
    assert_bitwise_equal((out, d_res, d_y), (want, want_res, want_y))


@pytest.mark.parametrize("dtype,fp32_table", [(torch.bfloat16, True), (torch.bfloat16, False), (torch.float32, True),
                                              (torch.float16, False)])
@pytest.mark.parametrize("lead,s,h,r", [((2,), 33, 40, 9), ((), 70, 136, 3), ((3,), 1, 24, 3)])
def test_dgate_within_budget_of_fp64(lead, s, h, r, dtype, fp32_table):
    residual, table, y, index, dout = _case(lead, s, h, r, dtype, fp32_table=fp32_table)
    gate = table[:, :h]
    got = _run(gate_residual, residual, gate, y, index, dout, "triton")
    gold = _run(lambda a, b, c, i: gate_residual_golden(a, b, c, i, dtype),
                residual.double(), gate.double(), y.double(), index, dout)
    base = _run(_eager, residual, gate.to(dtype), y, index, dout)
    assert got[2].dtype == gate.dtype
    assert_within_budget(got[2], gold[2], baseline=base[2].to(gold[2].dtype), out_dtype=gate.dtype, what="d_gate")


def test_batch_invariant_forward_and_dy():
    residual, table, y, index, dout = _case((8,), 7, 40, 3, torch.bfloat16)
    gate = table[:, :40]

    def run(rb, yb, db):
        out, _, _, dy = _run(gate_residual, rb, gate, yb, index, db, "triton")
        return out, dy

    assert_batch_invariant(run, (residual, y, dout), sizes=(2, 3, 8))


def test_batch_invariance_harness_catches_planted_fma():
    """Planted: one rounding (an FMA, emulated in fp64) instead of two whenever the batch has > 2 samples."""
    residual, table, y, index, _ = _case((8,), 7, 40, 3, torch.bfloat16, seed=2)
    gate = table[:, :40]

    def planted(rb, yb):
        if rb.shape[0] <= 2:
            return (_eager(rb, gate, yb, index),)
        fused = rb.double() + gate.double().index_select(0, index) * yb.double()
        return (fused.to(rb.dtype),)

    assert batch_invariance_failures(planted, (residual, y), sizes=(2, 3, 8))


def test_gradients_repeatable_over_runs():
    residual, table, y, index, dout = _case((2,), 70, 40, 9, torch.bfloat16)
    assert_repeatable(lambda: _run(gate_residual, residual, table[:, :40], y, index, dout, "triton"), runs=20)


def _bad_calls():
    residual, table, y, index, _ = _case((2,), 7, 24, 3, torch.bfloat16)
    gate = table[:, :24]
    f = gate_residual
    return [
        (TypeError, "residual", lambda: f(residual.int(), gate, y, index)),
        (ValueError, "residual", lambda: f(residual[0, 0], gate, y[0, 0], index)),
        (ValueError, "residual", lambda: f(residual.transpose(0, 1), gate, y, index)),
        (TypeError, "y", lambda: f(residual, gate, y.float(), index)),
        (ValueError, "y", lambda: f(residual, gate, y[:1], index)),
        (ValueError, "y", lambda: f(residual, gate, y.transpose(0, 1).contiguous().transpose(0, 1), index)),
        (TypeError, "gate", lambda: f(residual, gate.half(), y, index)),
        (ValueError, "gate", lambda: f(residual, gate[:, :23], y, index)),
        (ValueError, "gate", lambda: f(residual, table[:, ::6][:, :24], y, index)),
        (ValueError, "gate", lambda: f(residual, gate.to("meta"), y, index)),
        (TypeError, "index", lambda: f(residual, gate, y, index.float())),
        (ValueError, "index", lambda: f(residual, gate, y, index[:6])),
        (ValueError, "index", lambda: f(residual, gate, y, torch.full((7,), 3))),
        (ValueError, "index", lambda: f(residual, gate, y, torch.full((7,), -1))),
        (ValueError, "index", lambda: f(residual, gate, y, index.to("meta"))),
    ], (residual, table, y, index)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_bad_inputs_raise_before_launch_and_leave_inputs_unchanged(backend):
    calls, inputs = _bad_calls()
    with flowlock.use_backend(backend):
        assert_raise_before_launch(calls, inputs)


def test_unchecked_indices_skip_only_the_range_check():
    residual, table, y, index, _ = _case((), 7, 24, 3, torch.float32)
    with flowlock.use_backend("triton"):
        out = gate_residual(residual, table[:, :24], y, index, check_indices=False)
        with pytest.raises(ValueError, match="index"):
            gate_residual(residual, table[:, :24], y, index[:6], check_indices=False)
    assert_bitwise_equal(out, _eager(residual, table[:, :24], y, index))


def test_compiled_equals_eager():
    """torch.compile sees forward and backward as opaque custom ops: same bits as eager."""
    residual, table, y, index, dout = _case((2,), 33, 40, 9, torch.bfloat16)

    def fn(a, b, c, i):
        with flowlock.use_backend("triton"):
            return gate_residual(a, b, c, i, check_indices=False)

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    gate = table[:, :40]
    assert_bitwise_equal(_run(compiled, residual, gate, y, index, dout), _run(fn, residual, gate, y, index, dout))
