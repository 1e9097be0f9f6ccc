"""CUDA graphs of the strict H3 (``capture_h3``) on the GPU: a replayed training step or forward is
bitwise the eager strict call on the same values (outputs, latent gradients, every parameter
gradient), for several new latents and timesteps in a row, with gradient checkpointing on; a weight
rebound after capture refuses the replay. Tiny H3 and H3's full widths at 2 blocks + 1 refiner block.
Run on the H200: ``pytest -m gpu tests/models/test_h3_graphed_gpu.py``."""

import pytest
import torch

import flowlock
from flowlock.cuda_graphs import GraphInvalidated
from flowlock.models.minimax_h3 import build_packing, tiny_inputs
from flowlock.models.minimax_h3.graphed import capture_h3
from flowlock.models.minimax_h3.tiny import TINY_H3_CONFIG, full_width_config, make_h3
from flowlock.testing import assert_bitwise_equal

pytestmark = pytest.mark.gpu

LATENTS = ("hidden_states", "audio_hidden_states", "encoder_hidden_states")
CASES = {"tiny": (TINY_H3_CONFIG, None),
         "full_width": (full_width_config(num_layers=2, num_refiner_layers=1), build_packing(64, 3, 16, 16, 93))}


def _model(case: str):
    config, layout = CASES[case]
    model = make_h3(config, device="cuda", draw_on_device=case != "tiny").train()
    model.enable_gradient_checkpointing()
    return model, layout


def _inputs(case: str, seed: int, timestep: tuple[float, float]) -> dict:
    config, layout = CASES[case]
    inputs = tiny_inputs(1, seed=seed, config=config, packing=layout, timestep=timestep, device="cuda")
    for name in LATENTS:
        inputs[name] = inputs[name].requires_grad_()
    return inputs


def _cotangents(model, inputs):
    with torch.no_grad():
        out = model(**{k: v.detach() for k, v in inputs.items()}, return_dict=False)
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(t.shape, generator=gen).to(t.device) for t in out]


def _step(model, cots):
    def step(**inputs):
        out = model(**inputs, return_dict=False)
        loss = sum((o.float() * c).sum() for o, c in zip(out, cots))
        loss.backward()
        return [o.detach() for o in out]
    return step


def _eager(model, step, inputs) -> tuple[list, list, dict]:
    model.zero_grad(set_to_none=True)
    leaves = {k: (v.detach().clone().requires_grad_() if k in LATENTS else v) for k, v in inputs.items()}
    out = step(**leaves)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    latent_grads = [leaves[k].grad.clone() for k in LATENTS]
    model.zero_grad(set_to_none=True)
    return [o.clone() for o in out], latent_grads, grads


@pytest.mark.parametrize("case", list(CASES))
def test_replayed_step_is_the_eager_step(case):
    model, _ = _model(case)
    handle = flowlock.patch(model, mode="strict")
    first = _inputs(case, seed=0, timestep=(0.3, 0.55))
    step = _step(model, _cotangents(model, first))
    captured = capture_h3(model, step, first)
    for seed, timestep in ((1, (0.9, 0.2)), (2, (0.05, 0.7)), (0, (0.3, 0.55))):
        values = _inputs(case, seed, timestep)
        fresh = {k: values[k] for k in (*LATENTS, "timestep")}
        out = [o.clone() for o in captured(**fresh)]
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        latent_grads = [captured.input_grads[k].clone() for k in LATENTS]
        ref_out, ref_latent_grads, ref_grads = _eager(model, step, values)
        assert_bitwise_equal(out, ref_out, f"{case} replayed outputs, seed {seed}")
        assert_bitwise_equal(latent_grads, ref_latent_grads, f"{case} replayed latent gradients, seed {seed}")
        assert grads.keys() == ref_grads.keys() and len(grads) == len(list(model.parameters()))
        assert_bitwise_equal(list(grads.values()), list(ref_grads.values()), f"{case} replayed gradients, seed {seed}")
        # the eager reference cleared .grad; the next replay rebinds the graph's gradients
    captured()
    assert all(p.grad is not None for p in model.parameters())
    captured.release()
    assert all(p.grad is None for p in model.parameters())
    handle.remove()


def test_replayed_forward_is_the_eager_forward_and_a_rebound_weight_refuses():
    model, _ = _model("tiny")
    model.eval()
    handle = flowlock.patch(model, mode="strict")

    def forward(**inputs):
        with torch.no_grad():
            return model(**inputs, return_dict=False)

    captured = capture_h3(model, forward, {k: v.detach() for k, v in _inputs("tiny", 0, (0.3, 0.55)).items()})
    values = {k: v.detach() for k, v in _inputs("tiny", 4, (0.8, 0.1)).items()}
    out = [o.clone() for o in captured(hidden_states=values["hidden_states"], timestep=values["timestep"],
                                       audio_hidden_states=values["audio_hidden_states"],
                                       encoder_hidden_states=values["encoder_hidden_states"])]
    assert_bitwise_equal(out, list(forward(**values)), "replayed forward")
    with pytest.raises(ValueError, match="timestep"):
        captured(timestep=torch.tensor([0.5, 1.5], device="cuda"))
    block = model.transformer_blocks[0]
    block.ff.net[2].weight.data = block.ff.net[2].weight.data.clone()
    with pytest.raises(GraphInvalidated, match="transformer_blocks.0.ff.net.2.weight"):
        captured()
    handle.remove()
