"""The mapper against the real vLLM-Omni 0.30.0 ``MiniMaxH3DiTModel`` (CPU, through tests/vllm_omni_env)."""

import json
from types import SimpleNamespace

import pytest
import torch
import vllm_omni_env
from h3_checkpoints import config_of, save_diffusers, state_dict_of

from flowlock.checkpoint import H3Geometry, convert_directory, diffusers_to_native, name_table
from flowlock.checkpoint.minimax_h3.geometry import native_config
from flowlock.models.minimax_h3.tiny import full_width_config
from flowlock.testing import assert_bitwise_equal


def build_from_config(tf_model_config: dict):
    """A native model whose weight names are decided by ``tf_model_config`` alone (no override)."""
    vllm_omni_env.ensure_runtime()
    from vllm.config import set_current_vllm_config
    from vllm_omni.diffusion.models.minimax_h3.minimax_h3_transformer import MiniMaxH3DiTModel

    od_config = SimpleNamespace(tf_model_config=tf_model_config, parallel_config=SimpleNamespace(ulysses_degree=1),
                                cache_config={})
    with set_current_vllm_config(vllm_omni_env.vllm_config()):
        return MiniMaxH3DiTModel(od_config).eval()


def test_name_table_is_the_real_native_state_dict_at_h3_sizes(unpoisoned):
    vllm_omni_env.ensure_runtime()
    with torch.device("meta"):
        model = build_from_config(native_config(full_width_config(50, 2), "interleaved"))
    real = model.state_dict()
    table = name_table(H3Geometry.from_config(full_width_config(50, 2)))
    assert len(real) == 535 and len(list(model.named_parameters())) == 534
    assert {e.native: e.native_shape for e in table} == {k: tuple(v.shape) for k, v in real.items()}
    assert {e.native for e in table if e.fp32} == {k for k, v in real.items() if v.dtype == torch.float32}


@pytest.mark.parametrize("which", ["tiny", "full_names"])
def test_stacked_loads_strict_and_equals_what_load_weights_builds(request, which):
    model = request.getfixturevalue(f"{which}_model")
    sd, config = state_dict_of(model), config_of(model)
    reference = vllm_omni_env.build_native(config, sd).state_dict()  # vLLM-Omni's own diffusers-name loader
    native = diffusers_to_native(sd, config, qkv_layout="stacked")
    target = vllm_omni_env.build_native(config)
    target.load_state_dict(native, strict=True)
    assert list(native) == list(reference)
    for name, tensor in reference.items():
        assert_bitwise_equal(native[name], tensor, name)
        assert_bitwise_equal(target.state_dict()[name], tensor, name)


def test_interleaved_is_what_load_weights_reads_under_native_names(tiny_model):
    sd, config = state_dict_of(tiny_model), config_of(tiny_model)
    reference = vllm_omni_env.build_native(config, sd).state_dict()
    # Built from the config.json flowlock writes into a native directory: its class name must make the
    # model read native names, and its sizes must build the same model.
    target = build_from_config(native_config(config, "interleaved"))
    loaded = target.load_weights(diffusers_to_native(sd, config, qkv_layout="interleaved").items())
    assert loaded == set(reference)
    for name, tensor in reference.items():
        assert_bitwise_equal(target.state_dict()[name], tensor, name)


@pytest.mark.parametrize("layout", ["stacked", "interleaved"])
def test_a_converted_native_directory_is_what_the_engine_builds(tiny_model, tmp_path, layout):
    from safetensors.torch import load_file

    sd, config = state_dict_of(tiny_model), config_of(tiny_model)
    reference = vllm_omni_env.build_native(config, sd).state_dict()
    save_diffusers(tiny_model, tmp_path / "src", "150KB")
    convert_directory(tmp_path / "src", tmp_path / "native", to="native", qkv_layout=layout)
    native = tmp_path / "native"
    model = build_from_config(json.loads((native / "config.json").read_text()))
    weights = {k: v for shard in sorted(native.glob("*.safetensors")) for k, v in load_file(str(shard)).items()}
    if layout == "stacked":  # the in-memory layout: a plain strict load
        model.load_state_dict(weights, strict=True)
    else:  # the official on-disk layout: vLLM-Omni's native-name loader
        assert model.load_weights(weights.items()) == set(reference)
    for name, tensor in reference.items():
        assert_bitwise_equal(model.state_dict()[name], tensor, name)
