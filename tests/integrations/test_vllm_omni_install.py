"""install() / remove() on the real vLLM-Omni model: every forward restored by identity, vLLM-Omni's
own outputs back bitwise, provider mode running the stock path, no stock kernel on the strict path."""

import subprocess
import sys

import pytest
import torch
from engine_inputs import make_request, native_kwargs
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm_omni.diffusion.attention.layer import Attention
from vllm_omni.diffusion.layers.activation import SiluAndMul
from vllm_omni.diffusion.layers.norm import RMSNorm
from vllm_omni.diffusion.models.minimax_h3 import minimax_h3_transformer as h3
from vllm_omni.diffusion.models.minimax_h3.adaln_cache import MiniMaxH3RuntimeAdalnCache

import flowlock
from flowlock.integrations.vllm_omni import install
from flowlock.testing import assert_bitwise_equal

_MISSING = object()


def _forwards(model):
    return {name: module.__dict__.get("forward", _MISSING) for name, module in model.named_modules()}


def _run(model, kwargs):
    with torch.no_grad():
        return model(**kwargs)


def test_remove_restores_every_forward_and_the_stock_bits(fresh_native):
    kwargs = native_kwargs([make_request(seed=1)])
    before, stock = _forwards(fresh_native), _run(fresh_native, kwargs)
    handle = install(fresh_native)
    patched = {name for name, _ in handle.patched}
    assert {"", "token_refiner", "token_refiner.blocks.0", "blocks.0", "blocks.1", "time_embedder", "final_layer",
            "video_patch_proj", "condition_proj", "final_layer.audio_out"} <= patched
    with flowlock.mode("strict") as frame:
        _run(fresh_native, kwargs)
    assert {backend for _, backend in frame.ran} == {"reference"} and len(frame.ran) > 20
    with flowlock.mode("provider") as frame:
        assert_bitwise_equal(_run(fresh_native, kwargs), stock, "provider mode while installed")
    assert frame.ran == []
    handle.remove()
    after = _forwards(fresh_native)
    assert after.keys() == before.keys()
    assert all(after[name] is before[name] for name in before)
    assert_bitwise_equal(_run(fresh_native, kwargs), stock, "after remove()")
    with pytest.raises(RuntimeError, match="already removed"):
        handle.remove()


def test_install_refuses_a_second_install_another_class_and_another_mode(fresh_native, diffusers_model):
    with install(fresh_native):
        with pytest.raises(RuntimeError, match="already patched"):
            install(fresh_native)
    with pytest.raises(TypeError, match="MiniMaxH3DiTModel"):
        install(diffusers_model)
    with pytest.raises(ValueError, match="mode"):
        install(fresh_native, mode="provider")


def _refuse(*_, **__):
    raise AssertionError("a vLLM / vLLM-Omni kernel ran on the strict path")


def test_no_stock_kernel_and_no_adaln_cache_on_the_strict_path(fresh_native, monkeypatch):
    kwargs = native_kwargs([make_request(seed=2), make_request(seed=3, text_len=4)])
    for name in ("fused_qk_norm_rope", "rms_norm_indexed_scale_shift", "indexed_gate_rms_norm_scale_shift",
                 "indexed_gate", "indexed_scale_shift_"):
        monkeypatch.setattr(h3, name, _refuse)
    for cls, name in ((UnquantizedLinearMethod, "apply"), (SiluAndMul, "forward"), (RMSNorm, "forward"),
                      (Attention, "forward"), (MiniMaxH3RuntimeAdalnCache, "project"),
                      (MiniMaxH3RuntimeAdalnCache, "prepare")):
        monkeypatch.setattr(cls, name, _refuse)
    with install(fresh_native):
        video, audio = _run(fresh_native, kwargs)
        with flowlock.mode("provider"), pytest.raises(AssertionError, match="kernel ran"):
            _run(fresh_native, kwargs)
    assert video.isfinite().all() and audio.isfinite().all()


def test_importing_flowlock_and_the_adapter_imports_no_engine():
    code = ("import sys, flowlock, flowlock.integrations.vllm_omni; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'vllm_omni', 'cache_dit')); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_block_called_on_its_own_runs_strict_with_the_root_forwards_bits(engines):
    _, native = engines
    request = make_request(seed=4)
    seen = {}

    def record(module, args, kwargs, output):
        seen.update(args=args, kwargs=kwargs, output=output)

    hook = native.blocks[1].register_forward_hook(record, with_kwargs=True)
    try:
        _run(native, native_kwargs([request]))
    finally:
        hook.remove()
    # vLLM-Omni's own prepared table in place of the root's FP32 cos / sin: the same bits
    table = native.prepare_rope_table(native_kwargs([request])["img_position_ids"], seq_len=request.branch.seq_len)
    kwargs = {**seen["kwargs"], "rope_table": table}
    with flowlock.mode("strict") as frame, torch.no_grad():
        alone = native.blocks[1](*seen["args"], **kwargs)
    assert {"adaln_table", "attention", "gate_residual"} <= {op for op, _ in frame.ran}
    assert_bitwise_equal(alone, seen["output"], "blocks.1 called on its own")
