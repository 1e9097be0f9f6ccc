"""Shared helpers of the H3 model tests: a forward+backward with fixed cotangents, and the same under
inductor against eager."""

import torch

import flowlock
from flowlock.models.minimax_h3 import tiny_inputs

LATENTS = ("hidden_states", "audio_hidden_states", "encoder_hidden_states")


def cotangents(out, seed: int = 5):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(t.shape, generator=gen).to(t.device, t.dtype) for t in (out.sample, out.audio_sample)]


def forward_backward(model, inputs: dict, input_grad: bool = False):
    """Outputs (sample, audio_sample) and a name -> gradient dict of every parameter (plus
    ``"input:hidden_states"`` when ``input_grad``), for fixed per-element cotangents."""
    model.zero_grad(set_to_none=True)
    inputs = dict(inputs)
    if input_grad:
        inputs["hidden_states"] = inputs["hidden_states"].detach().clone().requires_grad_()
    out = model(**inputs)
    torch.autograd.backward([out.sample, out.audio_sample], cotangents(out))
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    if input_grad:
        grads["input:hidden_states"] = inputs["hidden_states"].grad
    return (out.sample.detach(), out.audio_sample.detach()), grads


def batch_fn(model, layout_inputs: dict):
    """``fn(*latents) -> (sample, audio_sample)`` for the batch-invariance harness."""
    structural = {k: v for k, v in layout_inputs.items() if k not in LATENTS}

    def fn(*latents):
        with torch.no_grad():
            out = model(**dict(zip(LATENTS, latents)), **structural)
        return out.sample, out.audio_sample

    return fn


def pool(batch: int, seed: int = 0) -> tuple[dict, tuple[torch.Tensor, ...]]:
    inputs = tiny_inputs(batch, seed=seed)
    return inputs, tuple(inputs[k] for k in LATENTS)


def inductor_and_eager(model, inputs: dict, how: str, backend: str):
    """Patched ``model``'s strict eager forward_backward (its ops checked to run on ``backend``), then
    the same under inductor compiled ``how`` ("regional": ``compile_repeated_blocks(fullgraph=True)``,
    "whole": ``torch.compile(model, fullgraph=True)``): ``(eager, compiled, graphs)``, each a
    forward_backward result (compiled gradient names without ``_orig_mod.``), ``graphs`` how many
    graphs inductor compiled."""
    from torch._inductor.compile_fx import compile_fx  # heavy: only the compile tests import inductor

    seen = []

    def inductor(gm, example_inputs):
        seen.append(gm)
        return compile_fx(gm, example_inputs)

    with flowlock.patch(model):
        with flowlock.mode("strict") as frame:
            eager = forward_backward(model, inputs, input_grad=True)
        assert {ran_on for _, ran_on in frame.ran} == {backend}
        if how == "regional":
            model.compile_repeated_blocks(fullgraph=True, backend=inductor)
            compiled = model
        else:
            compiled = torch.compile(model, fullgraph=True, backend=inductor)
        out, grads = forward_backward(compiled, inputs, input_grad=True)
    return eager, (out, {name.removeprefix("_orig_mod."): grad for name, grad in grads.items()}), len(seen)
