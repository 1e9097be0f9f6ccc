"""``flowlock convert`` end to end: diffusers directory -> native -> diffusers, bitwise, with index,
config and manifest; ``--verify`` and :func:`verify_directory` catch a changed directory."""

import io
import json
import sys

import pytest
import torch
from h3_checkpoints import config_of, read_checkpoint, save_diffusers, state_dict_of
from safetensors.torch import load_file, save_file

from flowlock.checkpoint import CheckpointError, diffusers_to_native, verify_directory
from flowlock.checkpoint.manifest import MANIFEST, sha256_file, write_manifest
from flowlock.cli import main
from flowlock.testing import assert_bitwise_equal


@pytest.mark.parametrize("which, shard", [("tiny", None), ("tiny", "150KB"), ("full_names", "40KB")])
@pytest.mark.parametrize("layout", ["stacked", "interleaved"])
def test_round_trip_through_the_cli_is_bitwise(request, tmp_path, capsys, which, shard, layout):
    model = request.getfixturevalue(f"{which}_model")
    src = save_diffusers(model, tmp_path / "src", shard)
    assert main(["convert", str(src), str(tmp_path / "native"), "--to", "native", "--qkv-layout", layout,
                 "--verify"]) == 0
    assert main(["convert", str(tmp_path / "native"), str(tmp_path / "back"), "--to", "diffusers", "--verify"]) == 0
    out = capsys.readouterr()
    assert "verified against its manifest" in out.out and out.err == ""  # no progress bar off a terminal

    native, native_config = read_checkpoint(tmp_path / "native")
    assert native_config["_class_name"] == "MiniMaxH3DiTModel"
    assert native_config["_flowlock"]["qkv_layout"] == layout
    expected = diffusers_to_native(state_dict_of(model), config_of(model), qkv_layout=layout)
    assert native.keys() == expected.keys()
    for name, tensor in expected.items():
        assert_bitwise_equal(native[name], tensor, name)

    original, original_config = read_checkpoint(src)
    back, back_config = read_checkpoint(tmp_path / "back")
    assert back_config == original_config
    assert back.keys() == original.keys()
    for name, tensor in original.items():
        assert_bitwise_equal(back[name], tensor, name)


def test_directories_hold_index_config_and_manifest(tiny_model, tmp_path):
    src = save_diffusers(tiny_model, tmp_path / "src", "150KB")
    assert main(["convert", str(src), str(tmp_path / "native"), "--to", "native"]) == 0
    native = tmp_path / "native"
    shards = sorted(p.name for p in native.glob("*.safetensors"))
    assert len(shards) > 1
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((native / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards) and len(index["weight_map"]) == 47
    manifest = json.loads((native / MANIFEST).read_text())
    assert manifest["kind"] == "native" and manifest["qkv_layout"] == "interleaved"  # the documented default
    assert set(manifest["files"]) == {*shards, "model.safetensors.index.json", "config.json"}
    assert all(sha256_file(native / f) == v["sha256"] for f, v in manifest["files"].items())
    assert (native.stat().st_mode & 0o777) != 0o700  # not mkdtemp's owner-only mode


def test_the_diffusers_output_loads_with_from_pretrained(tiny_model, tmp_path):
    from diffusers import MiniMaxH3Transformer3DModel

    src = save_diffusers(tiny_model, tmp_path / "src", "150KB")
    assert main(["convert", str(src), str(tmp_path / "native"), "--to", "native"]) == 0
    assert main(["convert", str(tmp_path / "native"), str(tmp_path / "back"), "--to", "diffusers"]) == 0
    loaded = MiniMaxH3Transformer3DModel.from_pretrained(str(tmp_path / "back")).state_dict()
    for name, tensor in tiny_model.state_dict().items():
        # from_pretrained upcasts to float32 by default; bf16 -> fp32 -> bf16 is exact.
        assert_bitwise_equal(loaded[name].to(tensor.dtype), tensor, name)


@pytest.fixture
def converted(tiny_model, tmp_path):
    src = save_diffusers(tiny_model, tmp_path / "src", "150KB")
    assert main(["convert", str(src), str(tmp_path / "native"), "--to", "native"]) == 0
    return tmp_path / "native"


def test_verify_catches_a_changed_byte(converted):
    shard = sorted(converted.glob("*.safetensors"))[1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{shard.name}: SHA-256 differs"):
        verify_directory(converted)


def test_verify_catches_an_added_and_a_removed_file(converted):
    (converted / "notes.txt").write_text("x")
    (converted / "config.json").unlink()
    with pytest.raises(CheckpointError) as info:
        verify_directory(converted)
    assert "config.json: listed in the manifest, not on disk" in str(info.value)
    assert "notes.txt: on disk, not in the manifest" in str(info.value)


def test_verify_rereads_the_tensors_not_only_the_hashes(converted):
    # A consistent manifest over a directory whose tensors are wrong: only the re-read catches it.
    index = json.loads((converted / "model.safetensors.index.json").read_text())
    shard = converted / index["weight_map"]["video_patch_proj.bias"]
    tensors = load_file(str(shard))
    tensors["video_patch_proj.bias"] = tensors["video_patch_proj.bias"].to(torch.bfloat16)
    save_file(tensors, str(shard))
    write_manifest(converted, "native", "interleaved")
    with pytest.raises(CheckpointError, match="video_patch_proj.bias: torch.bfloat16, but it is in the FP32 set"):
        verify_directory(converted)


def test_verify_without_a_manifest(tiny_model, tmp_path):
    src = save_diffusers(tiny_model, tmp_path / "src")
    with pytest.raises(CheckpointError, match="has no flowlock_manifest.json"):
        verify_directory(src)


def test_progress_bar_on_a_terminal(tiny_model, tmp_path, monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    src = save_diffusers(tiny_model, tmp_path / "src")
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(["convert", str(src), str(tmp_path / "native"), "--to", "native"]) == 0
    assert "flowlock convert: 100%" in terminal.getvalue() and "47/47" in terminal.getvalue()
