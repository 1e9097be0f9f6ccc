"""The strict H3 forward on the tiny real diffusers model: accuracy against an FP64 golden of the
whole model, batch invariance, repeatability, fusion and checkpointing invariance."""

import pytest
import torch
from h3_helpers import LATENTS, batch_fn, forward_backward, pool

import flowlock
import flowlock.models.minimax_h3.strict as strict_module
from flowlock.models.minimax_h3 import tiny_h3, tiny_inputs
from flowlock.models.minimax_h3.golden import golden_inputs, golden_model
from flowlock.models.minimax_h3.strict import rope_cos_sin
from flowlock.ops.linear import linear
from flowlock.testing import (
    assert_batch_invariant,
    assert_bitwise_equal,
    assert_repeatable,
    assert_within_budget,
    batch_invariance_failures,
)


@pytest.fixture(scope="module")
def stock():
    return tiny_h3()


@pytest.fixture(scope="module")
def patched():
    model = tiny_h3()
    handle = flowlock.patch(model)
    yield model
    handle.remove()


def test_rope_tables_bitwise_equal_to_diffusers(stock):
    positions = tiny_inputs(1)["position_ids"]
    assert_bitwise_equal(rope_cos_sin(stock.rope.inv_freq, positions), stock.rope(positions))


def test_forward_and_gradients_within_golden_budget(stock, patched):
    inputs = tiny_inputs(2)
    golden_out, golden_grads = forward_backward(golden_model(stock), golden_inputs(inputs), input_grad=True)
    eager_out, eager_grads = forward_backward(stock, inputs, input_grad=True)
    strict_out, strict_grads = forward_backward(patched, inputs, input_grad=True)
    for name, actual, golden, eager in zip(("sample", "audio_sample"), strict_out, golden_out, eager_out):
        assert_within_budget(actual, golden, baseline=eager, what=name)
    assert strict_grads.keys() == golden_grads.keys() == eager_grads.keys()
    for name, golden in golden_grads.items():
        assert_within_budget(strict_grads[name], golden, baseline=eager_grads[name], what=f"grad {name}")


def test_outputs_and_input_gradients_batch_invariant(patched):
    inputs, latents = pool(4)
    structural = {k: v for k, v in inputs.items() if k not in LATENTS}

    def fn(hidden, audio, text):
        hidden = hidden.clone().requires_grad_()
        out = patched(hidden_states=hidden, audio_hidden_states=audio, encoder_hidden_states=text, **structural)
        # Cotangents that are functions of each sample alone keep its gradient a per-sample quantity.
        loss = (out.sample * hidden.detach()[..., :1]).sum() + out.audio_sample.square().sum()
        (grad,) = torch.autograd.grad(loss, hidden)
        return out.sample.detach(), out.audio_sample.detach(), grad

    assert_batch_invariant(fn, latents, sizes=(2, 3, 4))


def test_harness_catches_a_planted_batch_dependent_linear(patched, monkeypatch):
    inputs, latents = pool(2)

    def planted(x, weight, bias=None, **kwargs):
        # Splits K into two separately rounded halves only when batched: a batch-dependent reduction.
        if x.shape[0] == 1 or x.dtype != torch.bfloat16:
            return linear(x, weight, bias, **kwargs)
        half = x.shape[-1] // 2
        out = linear(x[..., :half].contiguous(), weight[:, :half].contiguous())
        out = out + linear(x[..., half:].contiguous(), weight[:, half:].contiguous())
        return out if bias is None else out + bias

    monkeypatch.setattr(strict_module, "linear", planted)
    assert batch_invariance_failures(batch_fn(patched, inputs), latents, sizes=(2,))


def test_parameter_gradients_bitwise_repeatable(patched):
    inputs = tiny_inputs(2, seed=2)

    def run():
        _, grads = forward_backward(patched, inputs)
        return list(grads.values())

    assert_repeatable(run, runs=5)


def test_fused_projections_bitwise_equal_to_separate():
    inputs = tiny_inputs(2, seed=3)
    separate, fused = tiny_h3(), tiny_h3()
    fused.fuse_qkv_projections()
    assert all(block.attn.fused_projections for block in fused.transformer_blocks)
    with flowlock.patch(separate), flowlock.patch(fused):
        out_s, grads_s = forward_backward(separate, inputs)
        out_f, grads_f = forward_backward(fused, inputs)
    assert_bitwise_equal(out_f, out_s, "fused vs separate outputs")
    for prefix in [f"transformer_blocks.{i}.attn" for i in range(len(fused.transformer_blocks))] + [
            f"token_refiner.refiner_blocks.{i}.attn" for i in range(len(fused.token_refiner.refiner_blocks))]:
        stacked = torch.cat([grads_s[f"{prefix}.to_{p}.weight"] for p in "qkv"])
        assert_bitwise_equal(grads_f[f"{prefix}.to_qkv.weight"], stacked, f"{prefix} qkv weight grad")
        for p in "qkv":
            assert f"{prefix}.to_{p}.weight" not in grads_f
    for name, grad in grads_s.items():
        if ".to_q." not in name and ".to_k." not in name and ".to_v." not in name:
            assert_bitwise_equal(grads_f[name], grad, f"grad {name}")


def test_gradient_checkpointing_gives_the_same_bits():
    inputs = tiny_inputs(2, seed=4)
    model = tiny_h3()
    with flowlock.patch(model):
        out_plain, grads_plain = forward_backward(model, inputs, input_grad=True)
        model.enable_gradient_checkpointing()
        assert model.gradient_checkpointing and model.token_refiner.gradient_checkpointing
        with flowlock.mode("strict") as frame:
            out_ckpt, grads_ckpt = forward_backward(model, inputs, input_grad=True)
    # Recomputation runs the blocks again: more op calls than a plain forward has.
    assert sum(op == "attention" for op, _ in frame.ran) > 3
    # ... except the AdaLN projection: each block's forward keeps its table for its recomputation.
    blocks = len(model.transformer_blocks)
    assert [sum(op == name for op, _ in frame.ran) for name in ("adaln_table", "adaln_table_kept")] == [blocks, blocks]
    assert_bitwise_equal(out_ckpt, out_plain, "outputs")
    assert grads_ckpt.keys() == grads_plain.keys()
    assert_bitwise_equal(list(grads_ckpt.values()), list(grads_plain.values()), "gradients")


def test_reentrant_checkpointing_and_a_second_backward_give_the_same_bits():
    """A user's reentrant checkpoint function (the forward runs without grad, the recomputation with)
    and a retained graph's second backward (the kept tables are handed over once, then recomputed)."""
    inputs = tiny_inputs(1, seed=7)
    model = tiny_h3()
    with flowlock.patch(model):
        out_plain, grads_plain = forward_backward(model, inputs, input_grad=True)
        model.enable_gradient_checkpointing(
            lambda block, *args: torch.utils.checkpoint.checkpoint(block, *args, use_reentrant=True))
        with flowlock.mode("strict") as reentrant:
            out_ckpt, grads_ckpt = forward_backward(model, inputs, input_grad=True)
        assert [op for op, _ in reentrant.ran if op.startswith("adaln_table")] == (
            ["adaln_table"] * len(model.transformer_blocks) + ["adaln_table_kept"] * len(model.transformer_blocks))
        assert_bitwise_equal(out_ckpt, out_plain, "reentrant outputs")
        assert_bitwise_equal([grads_ckpt[k] for k in grads_plain], list(grads_plain.values()), "reentrant gradients")

        model.enable_gradient_checkpointing()
        model.zero_grad(set_to_none=True)
        out = model(**inputs)
        cotangents = [torch.ones_like(out.sample), torch.ones_like(out.audio_sample)]
        torch.autograd.backward([out.sample, out.audio_sample], cotangents, retain_graph=True)
        first = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        with flowlock.mode("strict") as frame:
            torch.autograd.backward([out.sample, out.audio_sample], cotangents)
        second = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    blocks = len(model.transformer_blocks)
    assert [op for op, _ in frame.ran if op.startswith("adaln_table")] == ["adaln_table"] * blocks
    assert second.keys() == first.keys()
    assert_bitwise_equal(list(second.values()), list(first.values()), "second backward")


@pytest.mark.slow
def test_whole_model_on_the_triton_interpreter_within_golden_budget(stock, patched):
    # About 45 s on one core: every Triton forward and backward kernel of the model, composed.
    inputs = tiny_inputs(1, seed=6)
    with flowlock.use_backend("triton"), flowlock.mode("strict") as frame:
        out, grads = forward_backward(patched, inputs, input_grad=True)
    assert {backend for _, backend in frame.ran} == {"triton"}
    golden_out, golden_grads = forward_backward(golden_model(stock), golden_inputs(inputs), input_grad=True)
    eager_out, eager_grads = forward_backward(stock, inputs, input_grad=True)
    for name, actual, golden, eager in zip(("sample", "audio_sample"), out, golden_out, eager_out):
        assert_within_budget(actual, golden, baseline=eager, what=f"interpreter {name}")
    assert grads.keys() == golden_grads.keys()
    for name, golden in golden_grads.items():
        assert_within_budget(grads[name], golden, baseline=eager_grads[name], what=f"interpreter grad {name}")
