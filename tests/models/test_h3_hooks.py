"""diffusers and accelerate hooks on a patched tiny H3: the strict path computes with the weights the
hooks prepare (layerwise casting, block-level group offloading, model CPU offload) or refuses with a
StrictModeError naming the hook (leaf-level group offloading, accelerate's sequential offload, any hook
installed before patching)."""

import copy

import pytest
import torch
from accelerate import cpu_offload, cpu_offload_with_hook
from diffusers.hooks import HookRegistry

import flowlock
from flowlock.models.minimax_h3 import tiny_h3, tiny_inputs
from flowlock.testing import assert_bitwise_equal


def _outputs(model, inputs):
    with torch.no_grad():
        out = model(**inputs)
    return out.sample, out.audio_sample


def _hooked(model, name):
    return [n for n, m in model.named_modules() if name in getattr(getattr(m, "_diffusers_hook", None), "hooks", {})]


def test_layerwise_casting_computes_with_the_upcast_storage_weights():
    model, inputs = tiny_h3(), tiny_inputs(2)
    reference = copy.deepcopy(model)
    handle = flowlock.patch(model)
    model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    cast = _hooked(model, "layerwise_casting")
    # Leaves inside the blocks, which the strict path reads without calling, and a patched linear.
    assert "transformer_blocks.0.attn.to_q" in cast and "context_embedder" in cast
    assert model.transformer_blocks[0].attn.to_q.weight.dtype == torch.float8_e4m3fn
    for name in cast:
        for p in reference.get_submodule(name).parameters(recurse=False):
            p.data = p.data.to(torch.float8_e4m3fn).to(torch.bfloat16)
    with flowlock.mode("strict") as frame:
        out = _outputs(model, inputs)
    assert frame.fallbacks == [] and ("linear", "reference") in frame.ran
    with flowlock.patch(reference):
        assert_bitwise_equal(out, _outputs(reference, inputs), "layerwise casting vs upcast weights")
    # Read, not cast in place: the storage stays fp8 after the forward.
    assert model.transformer_blocks[0].attn.to_q.weight.dtype == torch.float8_e4m3fn
    # The hook wraps the patched context_embedder and diffusers cannot remove it: neither can flowlock.
    with pytest.raises(RuntimeError, match="context_embedder.forward no longer holds"):
        handle.remove()


def test_block_level_group_offloading_reads_the_onloaded_weights(tmp_path):
    model, inputs = tiny_h3(), tiny_inputs(2)
    handle = flowlock.patch(model)
    plain = _outputs(model, inputs)
    model.enable_group_offload(onload_device="cpu", offload_device="cpu", offload_type="block_level",
                               num_blocks_per_group=1, offload_to_disk_path=str(tmp_path))
    # Offloaded to disk, a weight is an empty placeholder (NaN under the test session's poisoned
    # torch.empty_like) until its group's hook loads it back: reading it would show in the output.
    assert torch.isnan(model.transformer_blocks[1].ff.net[2].weight).all()
    assert torch.isnan(model.proj_out.weight).all()
    with flowlock.mode("strict") as frame:
        offloaded = _outputs(model, inputs)
    assert frame.fallbacks == []
    assert_bitwise_equal(offloaded, plain, "block-level group offloading")
    # Removing the hooks puts the strict forwards back, so the patch then comes off by identity.
    HookRegistry.check_if_exists_or_initialize(model).remove_hook("group_offloading", recurse=True)
    handle.remove()


def test_leaf_level_group_offloading_is_refused_by_name(tmp_path):
    model, inputs = tiny_h3(), tiny_inputs(1)
    flowlock.patch(model)
    model.enable_group_offload(onload_device="cpu", offload_device="cpu", offload_type="leaf_level",
                               offload_to_disk_path=str(tmp_path))
    with pytest.raises(flowlock.StrictModeError, match=r"refiner_blocks\.0\.attn\.to_q: hook group_offloading"):
        _outputs(model, inputs)
    with flowlock.mode("audit") as frame:
        out = _outputs(model, inputs)
    assert frame.fallbacks and all("group_offloading" in f.reason for f in frame.fallbacks)
    # The rope module holds its buffer in a group of its own: its tables come from calling it.
    assert "minimax_h3 rope" in [f.op for f in frame.fallbacks]
    assert all(torch.isfinite(t).all() for t in out)


def test_model_cpu_offload_hook_wraps_the_strict_forward():
    model, inputs = tiny_h3(), tiny_inputs(1)
    with flowlock.patch(model):
        plain = _outputs(model, inputs)
        _, hook = cpu_offload_with_hook(model, execution_device="cpu")
        calls = []
        pre_forward = model._hf_hook.pre_forward
        model._hf_hook.pre_forward = lambda *a, **k: (calls.append(1), pre_forward(*a, **k))[1]
        with flowlock.mode("strict") as frame:
            offloaded = _outputs(model, inputs)
        assert calls == [1] and frame.ran
        hook.remove()
    assert_bitwise_equal(offloaded, plain, "model CPU offload")


def test_sequential_cpu_offload_is_refused_by_name():
    model, inputs = tiny_h3(), tiny_inputs(1)
    flowlock.patch(model)
    cpu_offload(model, execution_device="cpu")
    assert model.transformer_blocks[0].attn.to_q.weight.device.type == "meta"
    with pytest.raises(flowlock.StrictModeError, match=r"attn\.to_q: hook accelerate AlignDevicesHook"):
        _outputs(model, inputs)


@pytest.mark.parametrize("enable, hook", [
    (lambda m: m.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16),
     "context_embedder carries hook layerwise_casting"),
    (lambda m: m.enable_group_offload(onload_device="cpu", offload_type="block_level", num_blocks_per_group=1),
     "<root> carries hook group_offloading"),
    (lambda m: cpu_offload_with_hook(m, execution_device="cpu"), "<root> carries hook accelerate CpuOffload"),
], ids=["layerwise_casting", "group_offload", "model_cpu_offload"])
def test_hooks_installed_before_patching_are_refused_and_nothing_changes(enable, hook):
    model = tiny_h3()
    enable(model)
    forwards = {name: m.__dict__.get("forward") for name, m in model.named_modules()}
    with pytest.raises(flowlock.StrictModeError, match=f"{hook}: call flowlock.patch before"):
        flowlock.patch(model)
    assert {name: m.__dict__.get("forward") for name, m in model.named_modules()} == forwards
