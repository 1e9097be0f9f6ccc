"""Gradient checkpointing of the strict H3 on the GPU's Triton kernels: a checkpointed training step
(each block's AdaLN table kept from its forward for its recomputation) is bitwise the step without
checkpointing, in outputs, latent gradients and every parameter gradient; the recomputation launches
no AdaLN projection of its own. H3's full widths at 2 blocks + 1 refiner block.
Run on the H200: ``pytest -m gpu tests/models/test_h3_checkpoint_gpu.py``."""

import pytest
import torch

import flowlock
import flowlock.ops.adaln.triton as adaln_triton
from flowlock.models.minimax_h3 import build_packing, tiny_inputs
from flowlock.models.minimax_h3.tiny import full_width_config, make_h3
from flowlock.testing import assert_bitwise_equal

pytestmark = pytest.mark.gpu

LATENTS = ("hidden_states", "audio_hidden_states", "encoder_hidden_states")


def _step(model, inputs, cotangents):
    model.zero_grad(set_to_none=True)
    leaves = {k: (v.detach().clone().requires_grad_() if k in LATENTS else v) for k, v in inputs.items()}
    out = model(**leaves, return_dict=False)
    sum((o.float() * c).sum() for o, c in zip(out, cotangents)).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return [o.detach().clone() for o in out], [leaves[k].grad.clone() for k in LATENTS], grads


def test_checkpointed_step_is_the_plain_step(monkeypatch):
    config = full_width_config(num_layers=2, num_refiner_layers=1)
    model = make_h3(config, device="cuda", draw_on_device=True).train()
    inputs = tiny_inputs(1, seed=0, config=config, packing=build_packing(64, 3, 16, 16, 93),
                         timestep=(0.3, 0.55), device="cuda")
    with torch.no_grad():
        shapes = [o.shape for o in model(**inputs, return_dict=False)]
    gen = torch.Generator().manual_seed(3)
    cotangents = [torch.randn(s, generator=gen).to("cuda") for s in shapes]
    projections = []
    launch = adaln_triton.adaln_table_fwd
    monkeypatch.setattr(adaln_triton, "adaln_table_fwd", lambda *a: (projections.append(1), launch(*a))[1])
    with flowlock.patch(model, mode="strict"):
        plain = _step(model, inputs, cotangents)
        plain_projections, projections[:] = len(projections), []
        model.enable_gradient_checkpointing()
        checkpointed = _step(model, inputs, cotangents)
    # One projection per block and the final norm's, with or without recomputation.
    assert plain_projections == len(projections) == config["num_layers"] + 1
    assert_bitwise_equal(checkpointed[0], plain[0], "outputs")
    assert_bitwise_equal(checkpointed[1], plain[1], "latent gradients")
    assert checkpointed[2].keys() == plain[2].keys()
    for name, grad in plain[2].items():
        assert_bitwise_equal(checkpointed[2][name], grad, f"grad {name}")
