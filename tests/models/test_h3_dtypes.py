"""The strict path on the tiny real diffusers H3 built in fp32, fp16 and bf16 with head dims 16 to
256: FP32 modules stay FP32, forward and every gradient within the budget of the model's FP64 golden,
batch-invariant; one model composed from the Triton kernels under the interpreter."""

import pytest
import torch
from h3_helpers import LATENTS, batch_fn, forward_backward

import flowlock
from flowlock.models.minimax_h3 import make_h3, tiny_inputs
from flowlock.models.minimax_h3.golden import golden_inputs, golden_model
from flowlock.models.minimax_h3.tiny import FP32_MODULES, TINY_H3_CONFIG
from flowlock.testing import assert_batch_invariant, assert_within_budget

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# (head dim, rope_freq_dim): RoPE rotates the leading 6 * rope_freq_dim channels of each head
HEADS = ((16, 2), (32, 4), (64, 8), (128, 16), (256, 16))


def _config(head_dim, rope_freq_dim, **more):
    return dict(TINY_H3_CONFIG, attention_head_dim=head_dim, rope_freq_dim=rope_freq_dim, **more)


def _fp32_modules_stay_fp32(model, dtype):
    for name, p in model.named_parameters():
        fp32 = any(name == k or name.startswith(k + ".") for k in FP32_MODULES)
        assert p.dtype == (torch.float32 if fp32 else dtype), name


def _check_against_golden(model, stock, inputs, what):
    golden_out, golden_grads = forward_backward(golden_model(stock), golden_inputs(inputs), input_grad=True)
    eager_out, eager_grads = forward_backward(stock, inputs, input_grad=True)
    strict_out, strict_grads = forward_backward(model, inputs, input_grad=True)
    for name, actual, golden, eager in zip(("sample", "audio_sample"), strict_out, golden_out, eager_out):
        assert actual.dtype == torch.float32, name
        assert_within_budget(actual, golden, baseline=eager, what=f"{what} {name}")
    assert strict_grads.keys() == golden_grads.keys()
    for name, golden in golden_grads.items():
        assert strict_grads[name].dtype == eager_grads[name].dtype, name
        assert_within_budget(strict_grads[name], golden, baseline=eager_grads[name], what=f"{what} grad {name}")


# every dtype at both ends of the head-dim range, every head dim in some dtype (bf16 at D = 128:
# test_h3_strict.py)
CASES = ([(dt, *HEADS[0]) for dt in DTYPES] + [(dt, *HEADS[-1]) for dt in DTYPES]
         + [(torch.float16, *HEADS[1]), (torch.float32, *HEADS[2]), (torch.float32, *HEADS[3]),
            (torch.float16, *HEADS[3])])


@pytest.mark.parametrize("dtype, head_dim, rope_freq_dim", CASES)
def test_strict_within_golden_budget(dtype, head_dim, rope_freq_dim):
    config = _config(head_dim, rope_freq_dim)
    stock, model = make_h3(config, dtype=dtype), make_h3(config, dtype=dtype)
    inputs = tiny_inputs(2, seed=head_dim, config=config)
    with flowlock.patch(model, mode="strict"), flowlock.mode("strict") as frame:
        _check_against_golden(model, stock, inputs, f"{dtype} D={head_dim}")
        _fp32_modules_stay_fp32(model, dtype)
    assert {op for op, _ in frame.ran} >= {"attention", "qk_norm_rope", "adaln_table", "linear", "swiglu"}


@pytest.mark.parametrize("dtype, head_dim, rope_freq_dim", ((torch.float32, 16, 2), (torch.float16, 64, 8)))
def test_strict_batch_invariant(dtype, head_dim, rope_freq_dim):
    config = _config(head_dim, rope_freq_dim)
    model = make_h3(config, dtype=dtype)
    inputs = tiny_inputs(3, seed=1, config=config)
    with flowlock.patch(model, mode="strict"):
        assert_batch_invariant(batch_fn(model, inputs), tuple(inputs[k] for k in LATENTS), sizes=(2, 3))


@pytest.mark.slow
def test_fp32_model_on_the_triton_interpreter_within_golden_budget():
    # Every Triton kernel of the model in true fp32 at the smallest head dim, one block of each kind.
    config = _config(16, 2, num_layers=1)
    stock, model = make_h3(config, dtype=torch.float32), make_h3(config, dtype=torch.float32)
    inputs = tiny_inputs(1, seed=7, config=config)
    with flowlock.patch(model, mode="strict"), flowlock.use_backend("triton"), flowlock.mode("strict") as frame:
        _check_against_golden(model, stock, inputs, "interpreter fp32 D=16")
    assert {backend for _, backend in frame.ran} == {"triton"}
