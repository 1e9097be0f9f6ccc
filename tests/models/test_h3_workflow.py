"""A diffusers user's day with a patched tiny H3: from_pretrained(torch_dtype=...) then patch,
save_pretrained of a patched model, diffusers' own LoRA entry points (load_lora_adapter, set_adapters,
fuse_lora) after patching, and an EMA copy. Fused qkv and gradient checkpointing are in
test_h3_strict."""

import copy

import pytest
import torch
from diffusers import MiniMaxH3Transformer3DModel
from diffusers.training_utils import EMAModel
from h3_helpers import forward_backward
from peft import LoraConfig
from safetensors.torch import load_file

import flowlock
from flowlock.models.common.peft_lora import is_peft_lora
from flowlock.models.minimax_h3 import tiny_h3, tiny_inputs
from flowlock.testing import assert_bitwise_equal

TARGETS = ["to_q", "to_v", "ff.net.2", "proj_out"]


def _outputs(model, inputs):
    with torch.no_grad(), flowlock.mode("strict") as frame:
        out = model(**inputs)
    assert frame.fallbacks == [] and frame.ran
    return out.sample, out.audio_sample


def test_from_pretrained_with_torch_dtype_then_patch(tmp_path):
    model, inputs = tiny_h3(), tiny_inputs(2)
    model.save_pretrained(tmp_path)
    loaded = MiniMaxH3Transformer3DModel.from_pretrained(tmp_path, torch_dtype=torch.bfloat16)
    # diffusers keeps the FP32 modules in fp32 under torch_dtype: the strict path serves that mix.
    assert {n: p.dtype for n, p in loaded.named_parameters()} == {n: p.dtype for n, p in model.named_parameters()}
    with flowlock.patch(model), flowlock.patch(loaded):
        assert_bitwise_equal(_outputs(loaded, inputs), _outputs(model, inputs), "loaded vs saved model")


def test_save_pretrained_of_a_patched_model_writes_the_stock_files(tmp_path):
    model = tiny_h3()
    model.save_pretrained(tmp_path / "stock")
    with flowlock.patch(model):
        assert all(isinstance(v, torch.Tensor) for v in model.state_dict().values())
        model.save_pretrained(tmp_path / "patched")
    stock_files = sorted(p.name for p in (tmp_path / "stock").iterdir())
    assert stock_files == sorted(p.name for p in (tmp_path / "patched").iterdir())
    for name in stock_files:
        if name.endswith(".safetensors"):
            stock, patched = load_file(tmp_path / "stock" / name), load_file(tmp_path / "patched" / name)
            assert stock.keys() == patched.keys()
            assert_bitwise_equal(list(patched.values()), list(stock.values()), name)
        else:
            assert (tmp_path / "patched" / name).read_bytes() == (tmp_path / "stock" / name).read_bytes(), name


def _adapter_dir(tmp_path):
    """A LoRA adapter with random factors, written by diffusers' save_lora_adapter."""
    source = tiny_h3()
    source.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights="gaussian"))
    gen = torch.Generator().manual_seed(3)
    for module in source.modules():
        if is_peft_lora(module):
            for factor in (module.lora_A["default"], module.lora_B["default"]):
                factor.weight.data = (torch.randn(factor.weight.shape, generator=gen) * 0.1).to(factor.weight.dtype)
    source.save_lora_adapter(tmp_path)
    return tmp_path / "pytorch_lora_weights.safetensors"


def test_diffusers_lora_entry_points_after_patching(tmp_path):
    inputs = tiny_inputs(2, seed=5)
    adapter = _adapter_dir(tmp_path / "adapter")
    before = tiny_h3()
    before.load_lora_adapter(str(adapter), prefix=None, adapter_name="a")
    model = tiny_h3()
    handle = flowlock.patch(model)
    base = _outputs(model, inputs)
    model.load_lora_adapter(str(adapter), prefix=None, adapter_name="a")
    # proj_out's slot now holds a peft layer whose base layer is the patched Linear.
    assert is_peft_lora(model.proj_out) and is_peft_lora(model.transformer_blocks[0].attn.to_q)
    with flowlock.patch(before):
        loaded = _outputs(model, inputs)
        assert_bitwise_equal(loaded, _outputs(before, inputs), "adapter loaded after vs before patching")
    assert not any(torch.equal(a, b) for a, b in zip(loaded, base))

    model.set_adapters(["a"], weights=[0.0])
    assert_bitwise_equal(_outputs(model, inputs), base, "adapter at weight 0")
    model.set_adapters(["a"], weights=[0.5])
    half = _outputs(model, inputs)
    assert not any(torch.equal(a, b) for a, b in zip(half, loaded))

    model.fuse_lora(lora_scale=1.0)
    fused = _outputs(model, inputs)
    # Fused, a LoRA layer is its merged base weight: the same bits as a plain model holding those weights.
    plain = tiny_h3()
    merged = {n.replace("base_layer.", ""): p for n, p in model.state_dict().items() if "lora_" not in n}
    plain.load_state_dict(merged)
    with flowlock.patch(plain):
        assert_bitwise_equal(fused, _outputs(plain, inputs), "fuse_lora vs merged weights")
    handle.remove()
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_ema_copy_of_a_patched_model_runs_strict_on_the_ema_weights():
    model, inputs = tiny_h3(), tiny_inputs(2, seed=6)
    flowlock.patch(model)
    ema = EMAModel(model.parameters(), decay=0.5)
    # EMAModel's first step copies the weights (decay 0); the second one averages.
    for _ in range(2):
        forward_backward(model, inputs)
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
        ema.step(model.parameters())
    ema_model = copy.deepcopy(model)
    ema.copy_to(ema_model.parameters())
    fresh = tiny_h3()
    fresh.load_state_dict(ema_model.state_dict())
    with flowlock.patch(fresh):
        assert_bitwise_equal(_outputs(ema_model, inputs), _outputs(fresh, inputs), "EMA copy vs fresh model")
    assert not any(torch.equal(a, b) for a, b in zip(_outputs(ema_model, inputs), _outputs(model, inputs)))
    with pytest.raises(RuntimeError, match="copy of a patched model"):
        flowlock.patch(ema_model)
