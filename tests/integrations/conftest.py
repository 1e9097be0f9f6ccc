"""Fixtures of the vLLM-Omni integration tests: one tiny diffusers H3 and the real vLLM-Omni
``MiniMaxH3DiTModel`` holding its weights (loaded by vLLM-Omni's own ``load_weights``)."""

import pytest
from engine_inputs import ENGINE_CONFIG
from vllm_omni_env import build_native

import flowlock
from flowlock.integrations.vllm_omni import install
from flowlock.models.minimax_h3 import make_h3


@pytest.fixture(scope="session")
def diffusers_model():
    return make_h3(ENGINE_CONFIG, seed=0)


@pytest.fixture
def fresh_native(diffusers_model):
    """A new native model with the diffusers weights, not patched."""
    return build_native(ENGINE_CONFIG, diffusers_model.state_dict())


@pytest.fixture(scope="session")
def engines(diffusers_model):
    """``(diffusers + flowlock.patch, vLLM-Omni + install)``, both strict, sharing weights."""
    native = build_native(ENGINE_CONFIG, diffusers_model.state_dict())
    with flowlock.patch(diffusers_model), install(native):
        yield diffusers_model, native
