"""Fixtures of the vLLM-Omni integration tests: one tiny diffusers H3 and the real vLLM-Omni
``MiniMaxH3DiTModel`` holding its weights (loaded by vLLM-Omni's own ``load_weights``)."""

import vllm_omni_env

# before anything imports vllm: a vllm without its compiled ops (the GPU bundle) must resolve the
# platforms a CPU host gets (a no-op where vllm is fully installed)
vllm_omni_env.pin_pure_python_platforms()

import pytest  # noqa: E402
import torch  # noqa: E402
from engine_inputs import ENGINE_CONFIG  # noqa: E402
from vllm_omni_env import build_native  # noqa: E402

import flowlock  # noqa: E402
from flowlock.integrations.vllm_omni import install  # noqa: E402
from flowlock.models.minimax_h3 import make_h3  # noqa: E402


@pytest.fixture(scope="session")
def diffusers_model():
    return make_h3(ENGINE_CONFIG, seed=0)


@pytest.fixture
def fresh_native(diffusers_model):
    """A new native model with the diffusers weights, not patched."""
    return build_native(ENGINE_CONFIG, diffusers_model.state_dict())


@pytest.fixture(scope="session")
def engines(diffusers_model):
    """``(diffusers + flowlock.patch, vLLM-Omni + install)``, both strict, sharing weights: BF16 with
    H3's FP32 modules."""
    native = build_native(ENGINE_CONFIG, diffusers_model.state_dict())
    with flowlock.patch(diffusers_model), install(native):
        yield diffusers_model, native


@pytest.fixture(scope="session")
def fp32_engines():
    """:func:`engines` with every parameter FP32 (other random weights of the same seed)."""
    diffusers = make_h3(ENGINE_CONFIG, seed=0, dtype=torch.float32)
    native = build_native(ENGINE_CONFIG, diffusers.state_dict(), dtype=torch.float32)
    with flowlock.patch(diffusers), install(native):
        yield diffusers, native
