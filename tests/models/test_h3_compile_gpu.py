"""torch.compile with inductor on the patched tiny H3 on CUDA (Triton backend): the ops are opaque
custom ops there, so the compiled forward and backward must be the eager bits, with one graph per
repeated block class (regional) or one graph (whole model). Run on the H200: ``pytest -m gpu
tests/models/test_h3_compile_gpu.py``."""

import pytest
import torch
from h3_helpers import inductor_and_eager

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
    eager, (out, grads), compiled_graphs = inductor_and_eager(model, tiny_inputs(2, device="cuda"), how, "triton")
    assert compiled_graphs == graphs
    assert_bitwise_equal(out, eager[0], f"{how} inductor outputs")
    assert grads.keys() == eager[1].keys()
    assert_bitwise_equal([grads[k] for k in eager[1]], list(eager[1].values()), f"{how} inductor gradients")
