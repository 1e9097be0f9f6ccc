"""Gradient checkpointing recomputes a block on whichever thread runs the backward (on CUDA, the
autograd engine's own), where the caller's thread-local flowlock mode is not set. The patched model
makes each checkpointed call carry the caller's mode, so a provider- or audit-mode forward is
recomputed in that mode whatever thread runs the backward. Without that, the provider forward's
blocks were recomputed on the strict path, which torch's checkpoint reports as a metadata mismatch."""

import contextlib
import threading

import pytest
import torch

import flowlock
from flowlock.models.common import patched_forward as h3_patch
from flowlock.models.minimax_h3 import tiny_h3, tiny_inputs
from flowlock.testing import mismatch_count

LATENTS = ("hidden_states", "audio_hidden_states", "encoder_hidden_states")


def _grads(model, inputs, mode: str, backward_thread: bool):
    model.zero_grad(set_to_none=True)
    leaves = {k: (v.clone().requires_grad_() if k in LATENTS else v) for k, v in inputs.items()}
    with flowlock.mode(mode):
        out = model(**leaves)
        loss = out.sample.float().square().sum() + out.audio_sample.float().square().sum()
        if not backward_thread:
            loss.backward()
    if backward_thread:
        errors = []
        thread = threading.Thread(target=lambda: _capture(errors, loss.backward))
        thread.start()
        thread.join()
        assert not errors, errors
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _capture(errors, fn):
    try:
        fn()
    except Exception as err:  # surfaced by the caller
        errors.append(err)


def _differ(a: dict, b: dict) -> list[str]:
    return [f"{n}: {mismatch_count(a[n], b[n])}" for n in a if not torch.equal(a[n], b[n])]


@pytest.mark.parametrize("mode", ["provider", "audit"])
def test_a_backward_on_another_thread_recomputes_in_the_callers_mode(mode):
    model = tiny_h3()
    model.enable_gradient_checkpointing()
    original = model._gradient_checkpointing_func
    inputs = tiny_inputs(2, seed=1)
    with flowlock.patch(model):
        same_thread = _grads(model, inputs, mode, backward_thread=False)
        other_thread = _grads(model, inputs, mode, backward_thread=True)
        assert model._gradient_checkpointing_func is original
    assert not _differ(other_thread, same_thread)


def test_without_the_binding_the_other_thread_recomputes_strict(monkeypatch):
    model = tiny_h3()
    model.enable_gradient_checkpointing()
    inputs = tiny_inputs(2, seed=1)
    monkeypatch.setattr(h3_patch, "_checkpoints_in_caller_state", lambda root: contextlib.nullcontext())
    with flowlock.patch(model), pytest.raises(AssertionError) as failed:
        _grads(model, inputs, "provider", backward_thread=True)
    assert "CheckpointError" in str(failed.value) and "different metadata" in str(failed.value)
