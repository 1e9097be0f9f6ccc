"""NaN and Inf in a source tensor: ``flowlock convert`` refuses them by tensor, shard and count, writes
nothing and leaves no DST; ``--allow-nonfinite`` copies them bit for bit and lists them. Each tensor is
checked as it is read, never read a second time."""

import pytest
import torch
from h3_checkpoints import config_of, read_checkpoint, split_evenly, state_dict_of, write_checkpoint

import flowlock.checkpoint.finite as finite
from flowlock.checkpoint import CheckpointError, convert_directory, diffusers_to_native
from flowlock.checkpoint.convert import save_shard
from flowlock.checkpoint.directory import SafetensorsDirectory
from flowlock.cli import main
from flowlock.testing import assert_bitwise_equal

SHARD = "diffusion_pytorch_model-{:05d}-of-00003.safetensors"


@pytest.fixture
def config(tiny_model):
    return {"_class_name": "MiniMaxH3Transformer3DModel", **config_of(tiny_model)}


def poisoned(tiny_model):
    """The tiny H3's tensors in 3 shards, NaN and Inf planted in the first and the last shard.

    Returns the shards and, per poisoned tensor, (shard number, NaN count, Inf count)."""
    shards = split_evenly(state_dict_of(tiny_model), 3)
    first, last = list(shards[0]), list(shards[2])
    planted = {first[0]: (1, 2, 0), first[-1]: (1, 0, 3), last[-1]: (3, 1, 1)}
    for name, (shard, nan, inf) in planted.items():
        flat = shards[shard - 1][name].reshape(-1)
        flat[:nan] = float("nan")
        flat[nan:nan + inf] = torch.tensor([float("inf"), float("-inf"), float("inf")][:inf], dtype=flat.dtype)
    return shards, planted


def test_refused_by_name_shard_and_count_leaving_nothing(capsys, tiny_model, config, tmp_path):
    shards, planted = poisoned(tiny_model)
    src = write_checkpoint(tmp_path / "src", shards, config)
    before = set(tmp_path.iterdir())
    assert main(["convert", str(src), str(tmp_path / "dst"), "--to", "native"]) == 1
    assert set(tmp_path.iterdir()) == before
    err = capsys.readouterr().err
    assert "holds NaN or Inf values; nothing was written" in err and "--allow-nonfinite" in err
    for name, (shard, nan, inf) in planted.items():
        numel = shards[shard - 1][name].numel()
        line = f"{name} in {SHARD.format(shard)}: {nan + inf} of {numel} elements are not finite ({nan} NaN, {inf} Inf)"
        assert line in err, (line, err)
    assert err.count(" are not finite ") == len(planted)


def test_each_tensor_is_read_once_and_nothing_is_written_after_a_finding(tiny_model, config, tmp_path):
    shards, _ = poisoned(tiny_model)
    src = write_checkpoint(tmp_path / "src", shards, config)
    reads, writes = [], []

    class Counting(SafetensorsDirectory):
        def load(self, name):
            reads.append(name)
            return super().load(name)

    def write(tensors, path):
        writes.append(path)
        save_shard(tensors, path)

    with pytest.raises(CheckpointError, match="NaN or Inf"):
        convert_directory(src, tmp_path / "dst", to="native", open_source=Counting, write_shard=write)
    assert sorted(reads) == sorted(name for shard in shards for name in shard)  # every tensor, each once
    assert writes == []  # the first input shard holds a finding, so no output shard was worth writing
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_allow_nonfinite_copies_the_bits_and_lists_them(capsys, tiny_model, config, tmp_path):
    shards, planted = poisoned(tiny_model)
    src = write_checkpoint(tmp_path / "src", shards, config)
    assert main(["convert", str(src), str(tmp_path / "native"), "--to", "native", "--allow-nonfinite"]) == 0
    out = capsys.readouterr().out
    assert out.count("copied with --allow-nonfinite: ") == len(planted)
    assert all(f"copied with --allow-nonfinite: {name} in " in out for name in planted)
    assert main(["convert", str(tmp_path / "native"), str(tmp_path / "back"), "--to", "diffusers",
                 "--allow-nonfinite"]) == 0
    back, _ = read_checkpoint(tmp_path / "back")
    for name, tensor in ((n, t) for shard in shards for n, t in shard.items()):
        assert_bitwise_equal(back[name], tensor, name)


def test_native_source_is_checked_too(capsys, tiny_model, config, tmp_path):
    native = diffusers_to_native(state_dict_of(tiny_model), config, qkv_layout="stacked")
    native["blocks.0.attn.qkv_proj.weight"][5, 1] = float("inf")
    src = write_checkpoint(tmp_path / "src", [native], config, prefix="model")
    before = set(tmp_path.iterdir())
    assert main(["convert", str(src), str(tmp_path / "dst"), "--to", "diffusers", "--qkv-layout", "stacked"]) == 1
    assert set(tmp_path.iterdir()) == before
    err = capsys.readouterr().err
    assert "blocks.0.attn.qkv_proj.weight in model-00001-of-00001.safetensors: 1 of " in err and "(0 NaN, 1 Inf)" in err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_count_is_exact_across_chunk_boundaries(monkeypatch, dtype):
    monkeypatch.setattr(finite, "_CHUNK", 7)
    tensor = torch.zeros(5, 9, dtype=dtype)
    bad = [0, 6, 7, 13, 14, 44]  # both sides of chunk edges, and the last element
    tensor.view(-1)[bad] = torch.tensor([float("nan"), float("inf"), float("-inf"), float("nan"), 1e30, float("nan")],
                                        dtype=torch.float64).to(dtype)
    expected = int((~torch.isfinite(tensor)).sum())
    assert expected == (5 if dtype in (torch.float32, torch.float64, torch.bfloat16) else 6)  # 1e30 is Inf in fp16
    assert finite.nonfinite_count(tensor) == expected
    assert finite.nonfinite_count(torch.arange(10)) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_one_nonfinite_element_anywhere_is_counted(dtype, value):
    # The sum screen must not miss a single element, wherever the vectorised reduction puts it.
    tensor = torch.randn(3, 1031, generator=torch.Generator().manual_seed(0)).to(dtype)
    for position in (0, 1, 15, 16, 17, 1030, 2047, 3092):
        poisoned = tensor.clone()
        poisoned.view(-1)[position] = value
        assert finite.nonfinite_count(poisoned) == 1, position


def test_an_overflowing_sum_of_finite_values_counts_zero():
    tensor = torch.full((64,), 65504.0, dtype=torch.float16)  # fp16's largest: the fp16 sum overflows
    assert not torch.isfinite(tensor.sum()) and finite.nonfinite_count(tensor) == 0
    tensor[5] = float("-inf")
    assert finite.nonfinite_count(tensor) == 1
