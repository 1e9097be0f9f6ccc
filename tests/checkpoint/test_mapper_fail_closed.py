"""Every refusal of the in-memory mapper: a CheckpointError naming the tensors, nothing returned."""

import pytest
import torch
from h3_checkpoints import config_of, state_dict_of

from flowlock.checkpoint import CheckpointError, H3Geometry, diffusers_to_native, native_to_diffusers


@pytest.fixture
def sd(tiny_model):
    return state_dict_of(tiny_model)


@pytest.fixture
def config(tiny_model):
    return config_of(tiny_model)


def refused(fn, *args, **kwargs) -> CheckpointError:
    with pytest.raises(CheckpointError) as info:
        fn(*args, **kwargs)
    return info.value


def test_unknown_name(sd, config):
    sd["transformer_blocks.0.attn.to_gate_compress.weight"] = sd["transformer_blocks.0.attn.to_q.weight"]
    err = refused(diffusers_to_native, sd, config, qkv_layout="stacked")
    assert "unknown tensors 1: transformer_blocks.0.attn.to_gate_compress.weight" in str(err)


def test_block_beyond_the_config_is_unknown(sd, config):
    sd["transformer_blocks.2.norm1.weight"] = sd["transformer_blocks.1.norm1.weight"]
    assert "transformer_blocks.2.norm1.weight" in str(refused(diffusers_to_native, sd, config, qkv_layout="stacked"))


def test_missing_name(sd, config):
    del sd["norm_out.linear.bias"], sd["transformer_blocks.1.ff.net.2.weight"]
    err = refused(diffusers_to_native, sd, config, qkv_layout="stacked")
    assert "missing tensors 2: norm_out.linear.bias, transformer_blocks.1.ff.net.2.weight" in str(err)


def test_duplicate_name_in_a_stream_of_pairs(sd, config):
    pairs = list(sd.items()) + [("proj_in.bias", sd["proj_in.bias"])]
    err = refused(diffusers_to_native, pairs, config, qkv_layout="stacked")
    assert "duplicate tensor names" in str(err) and "proj_in.bias" in str(err)


def test_incomplete_qkv_group(sd, config):
    del sd["token_refiner.refiner_blocks.0.attn.to_v.weight"]
    err = refused(diffusers_to_native, sd, config, qkv_layout="interleaved")
    assert ("incomplete q/k/v group token_refiner.blocks.0.attn.qkv_proj.weight (has "
            "token_refiner.refiner_blocks.0.attn.to_q.weight, token_refiner.refiner_blocks.0.attn.to_k.weight; "
            "lacks to_v)") in str(err)


def test_qkv_dtypes_that_differ(sd, config):
    sd["transformer_blocks.1.attn.to_k.weight"] = sd["transformer_blocks.1.attn.to_k.weight"].float()
    err = refused(diffusers_to_native, sd, config, qkv_layout="stacked")
    assert "q/k/v dtypes differ in blocks.1.attn.qkv_proj.weight" in str(err)


def test_qkv_part_of_the_wrong_shape(sd, config):
    sd["transformer_blocks.0.attn.to_q.weight"] = sd["transformer_blocks.0.attn.to_q.weight"][:128]
    err = refused(diffusers_to_native, sd, config, qkv_layout="stacked")
    assert "transformer_blocks.0.attn.to_q.weight: shape [128, 64], the config gives [256, 64]" in str(err)


def test_fp32_set_in_bf16(sd, config):
    sd["time_embedder.linear_2.weight"] = sd["time_embedder.linear_2.weight"].bfloat16()
    err = refused(diffusers_to_native, sd, config, qkv_layout="stacked")
    assert "time_embedder.linear_2.weight: torch.bfloat16, but it is in the FP32 set" in str(err)


def test_non_float_tensor(sd, config):
    sd["norm_out.norm.weight"] = sd["norm_out.norm.weight"].to(torch.int16)
    assert "not a floating-point dtype" in str(refused(diffusers_to_native, sd, config, qkv_layout="stacked"))


def test_every_problem_is_reported_at_once(sd, config):
    del sd["proj_out.bias"]
    sd["extra.weight"] = sd["proj_in.weight"]
    sd["proj_in.bias"] = sd["proj_in.bias"].half()
    assert len(refused(diffusers_to_native, sd, config, qkv_layout="stacked").problems) == 3


@pytest.mark.parametrize("layout", [None, "per-head", "STACKED"])
def test_layout_must_be_named(sd, config, layout):
    assert "qkv layout must be one of" in str(refused(diffusers_to_native, sd, config, qkv_layout=layout))


def test_native_names_given_as_diffusers(sd, config):
    native = diffusers_to_native(sd, config, qkv_layout="stacked")
    err = refused(diffusers_to_native, native, config, qkv_layout="stacked")
    assert "the source already is in the native layout" in str(err)


def test_native_rope_that_diffusers_would_not_recompute(sd, config):
    native = diffusers_to_native(sd, config, qkv_layout="stacked")
    native["rope.inv_freq"] = native["rope.inv_freq"].clone()
    native["rope.inv_freq"][3] = native["rope.inv_freq"][3].nextafter(torch.tensor(1.0))
    assert "rope.inv_freq is not the one diffusers computes" in str(
        refused(native_to_diffusers, native, config, qkv_layout="stacked"))


def test_native_fused_qkv_of_the_wrong_shape(sd, config):
    native = diffusers_to_native(sd, config, qkv_layout="stacked")
    native["blocks.0.attn.qkv_proj.weight"] = native["blocks.0.attn.qkv_proj.weight"][:-128]
    assert "blocks.0.attn.qkv_proj.weight: shape [640, 64], the config gives [768, 64]" in str(
        refused(native_to_diffusers, native, config, qkv_layout="interleaved"))


def test_config_without_a_size(config):
    del config["ffn_dim"]
    assert "missing keys: ffn_dim" in str(refused(H3Geometry.from_config, config))


def test_config_spellings_that_disagree(config):
    assert "disagrees" in str(refused(H3Geometry.from_config, {**config, "ffn_hidden_size": 7}))


def test_native_adaln_width_that_disagrees(config):
    assert "adaln_out_features = 5" in str(refused(H3Geometry.from_config, {**config, "adaln_out_features": 5}))


def test_config_sizes_that_are_not_sizes(config):
    err = refused(H3Geometry.from_config, {**config, "hidden_size": 64.5, "num_attention_heads": 0,
                                           "patch_size": [1, 2], "rope_theta": "big"})
    assert len(err.problems) == 4 and "hidden_size = 64.5 is not a positive integer" in str(err)
