"""torch.compile with inductor on the patched tiny H3 on CUDA (Triton backend): the ops are opaque
custom ops there, so the compiled forward and backward must be the eager bits, with one graph per
repeated block class (regional) or one graph (whole model). Run on the H200: ``pytest -m gpu
tests/models/test_h3_compile_gpu.py``."""

import pytest
import torch
from h3_helpers import forward_backward
from torch._inductor.compile_fx import compile_fx

import flowlock
from flowlock.models.minimax_h3 import tiny_inputs
from flowlock.models.minimax_h3.tiny import TINY_H3_CONFIG, make_h3
from flowlock.testing import assert_bitwise_equal

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("how, graphs", [("regional", 2), ("whole", 1)])
def test_inductor_compiled_strict_is_bitwise_eager(how, graphs):
    torch._dynamo.reset()
    # Regional: more blocks than the recompile limit, so a per-instance guard would show; whole: one
    # graph whatever the depth, kept shallow because inductor compiles the unrolled model at once.
    blocks = torch._dynamo.config.recompile_limit + 1 if how == "regional" else 2
    model = make_h3(dict(TINY_H3_CONFIG, num_layers=blocks, num_refiner_layers=blocks), device="cuda")
    inputs = tiny_inputs(2, device="cuda")
    seen = []

    def inductor(gm, example_inputs):
        seen.append(gm)
        return compile_fx(gm, example_inputs)

    with flowlock.patch(model):
        with flowlock.mode("strict") as frame:
            eager = forward_backward(model, inputs, input_grad=True)
        assert {backend for _, backend in frame.ran} == {"triton"}
        if how == "regional":
            model.compile_repeated_blocks(fullgraph=True, backend=inductor)
            compiled = model
        else:
            compiled = torch.compile(model, fullgraph=True, backend=inductor)
        out, grads = forward_backward(compiled, inputs, input_grad=True)
    assert len(seen) == graphs
    grads = {name.removeprefix("_orig_mod."): grad for name, grad in grads.items()}
    assert_bitwise_equal(out, eager[0], f"{how} inductor outputs")
    assert grads.keys() == eager[1].keys()
    assert_bitwise_equal([grads[k] for k in eager[1]], list(eager[1].values()), f"{how} inductor gradients")
