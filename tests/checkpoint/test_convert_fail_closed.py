"""Every refusal of ``flowlock convert``: exit status 1, the reason on stderr, and no DST (nor any
temporary directory) left behind."""

import json

import pytest
import torch
from h3_checkpoints import config_of, read_checkpoint, save_diffusers, split_evenly, state_dict_of, write_checkpoint

from flowlock.checkpoint import diffusers_to_native
from flowlock.cli import main


@pytest.fixture
def sd(tiny_model):
    return state_dict_of(tiny_model)


@pytest.fixture
def config(tiny_model):
    return {"_class_name": "MiniMaxH3Transformer3DModel", **config_of(tiny_model)}


def refuses(capsys, src, dst, *args) -> str:
    """Run the CLI, assert it exits 1 leaving nothing next to DST, return its stderr."""
    before = set(dst.parent.iterdir())
    assert main(["convert", str(src), str(dst), *args]) == 1
    assert set(dst.parent.iterdir()) == before
    return capsys.readouterr().err


def test_dst_exists(capsys, tiny_model, tmp_path):
    src = save_diffusers(tiny_model, tmp_path / "src")
    (tmp_path / "dst").mkdir()
    assert "exists: flowlock convert writes a new directory" in refuses(capsys, src, tmp_path / "dst", "--to", "native")


def test_no_config(capsys, tiny_model, tmp_path):
    src = save_diffusers(tiny_model, tmp_path / "src")
    (src / "config.json").unlink()
    assert "has no config.json" in refuses(capsys, src, tmp_path / "dst", "--to", "native")


def test_config_without_sizes(capsys, sd, config, tmp_path):
    del config["attention_head_dim"]
    src = write_checkpoint(tmp_path / "src", [sd], config)
    assert "missing keys: attention_head_dim" in refuses(capsys, src, tmp_path / "dst", "--to", "native")


def test_no_shards(capsys, config, tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text(json.dumps(config))
    assert "holds no *.safetensors file" in refuses(capsys, tmp_path / "src", tmp_path / "dst", "--to", "native")


def test_not_a_safetensors_file(capsys, tiny_model, tmp_path):
    src = save_diffusers(tiny_model, tmp_path / "src")
    (src / "diffusion_pytorch_model.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops")
    assert "is not a readable safetensors file" in refuses(capsys, src, tmp_path / "dst", "--to", "native")


def test_unknown_tensor(capsys, sd, config, tmp_path):
    shards = split_evenly(sd, 3)
    shards[2]["transformer_blocks.0.ff.net.1.weight"] = torch.zeros(3)
    src = write_checkpoint(tmp_path / "src", shards, config)
    err = refuses(capsys, src, tmp_path / "dst", "--to", "native")
    assert "unknown tensors 1: transformer_blocks.0.ff.net.1.weight" in err


def test_missing_tensor(capsys, sd, config, tmp_path):
    del sd["audio_proj_out.weight"]
    src = write_checkpoint(tmp_path / "src", split_evenly(sd, 3), config)
    assert "missing tensors 1: audio_proj_out.weight" in refuses(capsys, src, tmp_path / "dst", "--to", "native")


def test_tensor_in_two_shards(capsys, sd, config, tmp_path):
    shards = split_evenly(sd, 2)
    shards[1]["proj_in.weight"] = sd["proj_in.weight"]
    src = write_checkpoint(tmp_path / "src", shards, config, index=False)
    err = refuses(capsys, src, tmp_path / "dst", "--to", "native")
    assert "duplicate tensors" in err
    assert "proj_in.weight (diffusion_pytorch_model-00001-of-00002.safetensors and " in err


def test_index_names_a_tensor_twice(capsys, sd, config, tmp_path):
    src = write_checkpoint(tmp_path / "src", [sd], config)
    index = src / "diffusion_pytorch_model.safetensors.index.json"
    text = index.read_text()
    index.write_text(text.replace('"weight_map": {', '"weight_map": {"proj_in.bias": "x.safetensors", ', 1))
    assert "names the same key twice" in refuses(capsys, src, tmp_path / "dst", "--to", "native")


def test_index_and_headers_disagree(capsys, sd, config, tmp_path):
    src = write_checkpoint(tmp_path / "src", split_evenly(sd, 2), config)
    index = src / "diffusion_pytorch_model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["proj_in.weight"] = "diffusion_pytorch_model-00002-of-00002.safetensors"
    del data["weight_map"]["proj_out.bias"]
    index.write_text(json.dumps(data))
    err = refuses(capsys, src, tmp_path / "dst", "--to", "native")
    assert "the index and the shard headers disagree" in err
    assert "proj_in.weight: index says diffusion_pytorch_model-00002-of-00002.safetensors" in err
    assert "proj_out.bias: in diffusion_pytorch_model-00002-of-00002.safetensors but not in the index" in err


def test_index_names_a_missing_shard(capsys, sd, config, tmp_path):
    src = write_checkpoint(tmp_path / "src", split_evenly(sd, 2), config)
    (src / "diffusion_pytorch_model-00002-of-00002.safetensors").unlink()
    assert "names shards that are not in" in refuses(capsys, src, tmp_path / "dst", "--to", "native")


def test_incomplete_qkv_across_shards(capsys, sd, config, tmp_path):
    del sd["transformer_blocks.1.attn.to_q.weight"]
    src = write_checkpoint(tmp_path / "src", split_evenly(sd, 4), config)
    err = refuses(capsys, src, tmp_path / "dst", "--to", "native")
    assert "incomplete q/k/v group blocks.1.attn.qkv_proj.weight" in err and "lacks to_q" in err


def test_mismatched_qkv(capsys, sd, config, tmp_path):
    sd["transformer_blocks.0.attn.to_v.weight"] = sd["transformer_blocks.0.attn.to_v.weight"].half()
    src = write_checkpoint(tmp_path / "src", [sd], config)
    assert "q/k/v dtypes differ in blocks.0.attn.qkv_proj.weight" in refuses(capsys, src, tmp_path / "dst",
                                                                               "--to", "native")


def test_fp32_set_not_fp32(capsys, sd, config, tmp_path):
    sd["proj_out.weight"] = sd["proj_out.weight"].bfloat16()
    src = write_checkpoint(tmp_path / "src", [sd], config)
    assert "proj_out.weight: torch.bfloat16, but it is in the FP32 set" in refuses(capsys, src, tmp_path / "dst",
                                                                                     "--to", "native")


def test_already_in_the_target_layout(capsys, tiny_model, tmp_path):
    src = save_diffusers(tiny_model, tmp_path / "src")
    assert "already holds diffusers names" in refuses(capsys, src, tmp_path / "dst", "--to", "diffusers")


def foreign_native(sd, config, path, layout="interleaved"):
    """A native directory flowlock did not write: native names, a diffusers-spelled config, no layout record."""
    return write_checkpoint(path, split_evenly(diffusers_to_native(sd, config, qkv_layout=layout), 2), config,
                            prefix="model")


def test_native_layout_unrecorded_and_not_given(capsys, sd, config, tmp_path):
    src = foreign_native(sd, config, tmp_path / "src")
    err = refuses(capsys, src, tmp_path / "dst", "--to", "diffusers")
    assert "cannot be told apart by shape: pass --qkv-layout" in err


def test_foreign_native_with_the_layout_given(sd, config, tmp_path):
    src = foreign_native(sd, config, tmp_path / "src")
    assert main(["convert", str(src), str(tmp_path / "dst"), "--to", "diffusers", "--qkv-layout", "interleaved"]) == 0
    back, _ = read_checkpoint(tmp_path / "dst")
    assert back.keys() == sd.keys() and all(torch.equal(back[k], v) for k, v in sd.items())


def test_layout_that_contradicts_the_record(capsys, tiny_model, tmp_path):
    src = save_diffusers(tiny_model, tmp_path / "src")
    assert main(["convert", str(src), str(tmp_path / "native"), "--to", "native", "--qkv-layout", "stacked"]) == 0
    err = refuses(capsys, tmp_path / "native", tmp_path / "dst", "--to", "diffusers", "--qkv-layout", "interleaved")
    assert "contradicts the source's recorded layout stacked" in err


def test_native_rope_that_diffusers_would_not_recompute(capsys, sd, config, tmp_path):
    native = diffusers_to_native(sd, config, qkv_layout="stacked")
    native["rope.inv_freq"] = native["rope.inv_freq"] * 2
    src = write_checkpoint(tmp_path / "src", [native], config, prefix="model")
    err = refuses(capsys, src, tmp_path / "dst", "--to", "diffusers", "--qkv-layout", "stacked")
    assert "rope.inv_freq is not the one diffusers computes" in err


def test_bad_layout_argument_is_refused_by_the_parser(tiny_model, tmp_path):
    src = save_diffusers(tiny_model, tmp_path / "src")
    with pytest.raises(SystemExit) as info:
        main(["convert", str(src), str(tmp_path / "dst"), "--to", "native", "--qkv-layout", "grouped"])
    assert info.value.code == 2 and not (tmp_path / "dst").exists()


def test_truncated_shard(capsys, tiny_model, tmp_path):
    src = save_diffusers(tiny_model, tmp_path / "src", "150KB")
    shard = sorted(src.glob("*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-4])
    err = refuses(capsys, src, tmp_path / "dst", "--to", "native")
    assert f"{shard.name}: tensor byte ranges do not match" in err and "(truncated?)" in err


def test_src_is_not_a_directory(capsys, tmp_path):
    assert "is not a directory" in refuses(capsys, tmp_path / "nowhere", tmp_path / "dst", "--to", "native")


def test_dst_parent_missing(capsys, tiny_model, tmp_path):
    src = save_diffusers(tiny_model, tmp_path / "src")
    assert main(["convert", str(src), str(tmp_path / "no" / "dst"), "--to", "native"]) == 1
    assert "(the parent of DST) is not a directory" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
