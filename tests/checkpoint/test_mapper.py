"""The in-memory mapper on the tiny diffusers H3 and on a checkpoint with all 638 H3 names."""

import pytest
import torch
from h3_checkpoints import FULL_NAMES_CONFIG, config_of, state_dict_of

from flowlock.checkpoint import (
    H3Geometry,
    diffusers_to_native,
    fuse_qkv,
    name_table,
    native_to_diffusers,
    rope_inv_freq,
    split_qkv,
)
from flowlock.models.minimax_h3.tiny import FP32_MODULES, full_width_config
from flowlock.testing import assert_bitwise_equal


def test_name_table_is_the_real_diffusers_state_dict_at_h3_sizes(unpoisoned):
    from diffusers import MiniMaxH3Transformer3DModel

    with torch.device("meta"):
        model = MiniMaxH3Transformer3DModel(**full_width_config(num_layers=50, num_refiner_layers=2))
    real = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    table = name_table(H3Geometry.from_config(full_width_config(50, 2)))
    ours = {n: s for e in table for n, s in zip(e.diffusers, e.diffusers_shapes)}
    assert len(real) == 638 and ours == real
    assert len(table) == 535 and sum(e.kind == "rope" for e in table) == 1
    fp32 = {n for e in table if e.fp32 for n in e.diffusers}
    assert fp32 == {n for n in real if n.split(".")[0] in FP32_MODULES}


@pytest.mark.parametrize("which", ["tiny", "full_names"])
@pytest.mark.parametrize("layout", ["stacked", "interleaved"])
def test_round_trip_is_bitwise(request, which, layout):
    model = request.getfixturevalue(f"{which}_model")
    sd = state_dict_of(model)
    native = diffusers_to_native(sd, config_of(model), qkv_layout=layout)
    assert len(native) == (535 if which == "full_names" else 47)
    back = native_to_diffusers(native, config_of(model), qkv_layout=layout)
    assert back.keys() == sd.keys()
    for name, tensor in sd.items():
        assert_bitwise_equal(back[name], tensor, name)


def test_layouts_fc1_fp32_and_rope_on_all_638_names(full_names_model):
    sd = state_dict_of(full_names_model)
    g = H3Geometry.from_config(FULL_NAMES_CONFIG)
    stacked = diffusers_to_native(sd, FULL_NAMES_CONFIG, qkv_layout="stacked")
    interleaved = diffusers_to_native(sd, FULL_NAMES_CONFIG, qkv_layout="interleaved")
    inner, d = g.inner_dim, g.attention_head_dim
    for prefix, native in [(f"transformer_blocks.{i}.", f"blocks.{i}.") for i in range(50)] + \
                          [(f"token_refiner.refiner_blocks.{i}.", f"token_refiner.blocks.{i}.") for i in range(2)]:
        q, k, v = (sd[f"{prefix}attn.to_{p}.weight"] for p in "qkv")
        assert_bitwise_equal(stacked[f"{native}attn.qkv_proj.weight"], torch.cat((q, k, v)), native)
        fused = interleaved[f"{native}attn.qkv_proj.weight"]
        for h in range(g.num_attention_heads):
            for slot, part in enumerate((q, k, v)):
                assert_bitwise_equal(fused[(3 * h + slot) * d:(3 * h + slot + 1) * d], part[h * d:(h + 1) * d])
        fc1, ff = stacked[f"{native}mlp.fc1.weight"], sd[f"{prefix}ff.net.0.proj.weight"]
        assert_bitwise_equal(fc1[:g.ffn_dim], ff[g.ffn_dim:])
        assert_bitwise_equal(fc1[g.ffn_dim:], ff[:g.ffn_dim])
        assert stacked[f"{native}attn.qkv_proj.weight"].shape == (3 * inner, g.hidden_size)
    for entry in name_table(g):
        assert (stacked[entry.native].dtype == torch.float32) == entry.fp32, entry.native
    assert_bitwise_equal(stacked["rope.inv_freq"], full_names_model.rope.inv_freq)


def test_rope_matches_the_diffusers_buffer_at_h3_sizes():
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3RotaryPosEmbed

    assert_bitwise_equal(rope_inv_freq(16, 10000.0), MiniMaxH3RotaryPosEmbed(16, 10000.0).inv_freq)


@pytest.mark.parametrize("layout", ["stacked", "interleaved"])
def test_split_inverts_fuse_and_owns_its_storage(layout):
    q, k, v = (torch.randn(6, 5).to(torch.bfloat16) for _ in range(3))
    fused = fuse_qkv(q, k, v, layout, head_dim=2)
    parts = split_qkv(fused, layout, head_dim=2)
    assert_bitwise_equal(parts, (q, k, v))
    assert len({p.untyped_storage().data_ptr() for p in (*parts, fused)}) == 4
    assert all(p.is_contiguous() for p in parts)


def test_the_two_layouts_differ_but_have_one_shape():
    q, k, v = (torch.full((4, 3), float(i)) for i in range(3))
    stacked, interleaved = (fuse_qkv(q, k, v, lay, head_dim=2) for lay in ("stacked", "interleaved"))
    assert stacked.shape == interleaved.shape and not torch.equal(stacked, interleaved)
    assert interleaved[:, 0].tolist() == [0, 0, 1, 1, 2, 2, 0, 0, 1, 1, 2, 2]


def test_importing_the_package_imports_no_engine():
    import subprocess
    import sys

    code = ("import sys, flowlock.checkpoint; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'diffusers', 'vllm', 'vllm_omni', 'safetensors'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
