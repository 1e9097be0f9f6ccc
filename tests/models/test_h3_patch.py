"""flowlock.patch on the tiny H3: reversible by identity, state untouched, provider A/B, strict
failures named, structural inputs validated before any op runs."""

import copy

import pytest
import torch
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3AttnProcessor
from h3_helpers import forward_backward
from torch import nn

import flowlock
from flowlock.models.minimax_h3 import tiny_h3, tiny_inputs
from flowlock.testing import assert_bitwise_equal


def _state(model):
    return {k: (v.dtype, v.data_ptr(), tuple(v.shape)) for k, v in model.state_dict().items()}


def _outputs(model, inputs):
    with torch.no_grad():
        out = model(**inputs)
    return out.sample, out.audio_sample


def test_state_dict_untouched_and_remove_restores_provider_by_identity():
    model, inputs = tiny_h3(), tiny_inputs(2)
    state = _state(model)
    fp32_modules = {n: p for n, p in model.named_parameters() if p.dtype == torch.float32}
    before = _outputs(model, inputs)
    handle = flowlock.patch(model)
    blocks = [f"transformer_blocks.{i}" for i in range(len(model.transformer_blocks))]
    refiners = [f"token_refiner.refiner_blocks.{i}" for i in range(len(model.token_refiner.refiner_blocks))]
    others = ["norm_out", "token_refiner.final_norm", "time_embedder", "proj_in", "audio_proj_in",
              "context_embedder", "proj_out", "audio_proj_out"]
    assert handle.patched == [(name, "forward") for name in ["", *refiners, *blocks, *others]]
    assert _state(model) == state
    strict = _outputs(model, inputs)
    handle.remove()
    assert handle.patched == []
    assert _state(model) == state
    assert {n: p for n, p in model.named_parameters() if p.dtype == torch.float32} == fp32_modules
    for module in model.modules():
        assert "forward" not in module.__dict__
    assert model.forward.__func__ is type(model).forward
    assert_bitwise_equal(_outputs(model, inputs), before, "provider after remove")
    assert not all(torch.equal(a, b) for a, b in zip(strict, before)), "strict path did not run"


def test_provider_mode_runs_the_original_forward():
    model, inputs = tiny_h3(), tiny_inputs(2)
    before = forward_backward(model, inputs)
    with flowlock.patch(model), flowlock.mode("provider") as frame:
        during = forward_backward(model, inputs)
    assert frame.ran == []
    assert_bitwise_equal(during[0], before[0], "provider outputs")
    assert_bitwise_equal(list(during[1].values()), list(before[1].values()), "provider gradients")


def test_preexisting_instance_forward_is_kept_and_restored():
    model, inputs = tiny_h3(), tiny_inputs(1)
    calls = []
    stock_forward = model.forward

    def wrapper(*args, **kwargs):
        calls.append(1)
        return stock_forward(*args, **kwargs)

    model.forward = wrapper
    handle = flowlock.patch(model)
    with flowlock.mode("provider"):
        _outputs(model, inputs)
    assert calls == [1]
    _outputs(model, inputs)
    assert calls == [1]
    handle.remove()
    assert model.__dict__["forward"] is wrapper


def test_patch_twice_and_remove_twice_raise():
    model = tiny_h3()
    handle = flowlock.patch(model)
    with pytest.raises(RuntimeError, match="already patched"):
        flowlock.patch(model)
    handle.remove()
    with pytest.raises(RuntimeError, match="already removed"):
        handle.remove()
    flowlock.patch(model).remove()


def test_remove_refuses_to_overwrite_a_foreign_forward():
    model = tiny_h3()
    handle = flowlock.patch(model)
    model.forward = lambda *a, **k: None
    with pytest.raises(RuntimeError, match="foreign change"):
        handle.remove()


def test_patch_rejects_other_models_and_modes():
    with pytest.raises(TypeError, match="MiniMaxH3"):
        flowlock.patch(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="mode"):
        flowlock.patch(tiny_h3(), mode="provider")


def _bad_layout_cases():
    def tag3(kw):
        kw["token_tags"] = kw["token_tags"].clone()
        kw["token_tags"][3] = 3

    def index_out_of_range(kw):
        kw["video_indices"] = kw["video_indices"].clone()
        kw["video_indices"][0] = kw["position_ids"].shape[0]

    def timestep_1000(kw):
        kw["timestep"] = torch.tensor([1000.0, 0.5])

    def timestep_index(kw):
        kw["timestep_indices"] = kw["timestep_indices"] + 1

    def overlap(kw):
        kw["audio_indices"] = kw["audio_indices"].clone()
        kw["audio_indices"][0] = kw["text_indices"][0]

    def positions(kw):
        kw["position_ids"] = kw["position_ids"][:, :2]

    def batch(kw):
        kw["audio_hidden_states"] = kw["audio_hidden_states"][:1]

    return [("tag 3", tag3, "token_tags"), ("index out of range", index_out_of_range, "video_indices"),
            ("timestep 1000", timestep_1000, "timestep"), ("timestep index", timestep_index, "timestep_indices"),
            ("overlapping rows", overlap, "disjoint"), ("positions", positions, "position_ids"),
            ("batch mismatch", batch, "audio_hidden_states")]


@pytest.mark.parametrize("case", _bad_layout_cases(), ids=lambda c: c[0])
def test_bad_structure_raises_before_any_op(case):
    _, mutate, word = case
    model, inputs = tiny_h3(), tiny_inputs(2)
    mutate(inputs)
    before = {k: v.clone() for k, v in inputs.items()}
    with flowlock.patch(model), flowlock.mode("strict") as frame, pytest.raises(ValueError, match=word):
        model(**inputs)
    assert frame.ran == []
    for key, value in inputs.items():
        assert_bitwise_equal(value, before[key], key)


def test_layout_checked_once_is_rechecked_after_an_in_place_change():
    model, inputs = tiny_h3(), tiny_inputs(1)
    with flowlock.patch(model), flowlock.mode("strict"), torch.no_grad():
        model(**inputs)
        inputs["audio_indices"][0] = inputs["text_indices"][0]
        with pytest.raises(ValueError, match="disjoint"):
            model(**inputs)


class _ScaledLinear(nn.Linear):
    """A Linear subclass: not ``torch.nn.Linear`` exactly, so strict cannot vouch for it."""


def _swap_ff_out(model):
    old = model.transformer_blocks[1].ff.net[2]
    new = _ScaledLinear(old.in_features, old.out_features, bias=False, dtype=old.weight.dtype)
    new.weight = old.weight
    model.transformer_blocks[1].ff.net[2] = new


def test_unknown_module_raises_in_strict_and_falls_back_in_audit():
    model, inputs = tiny_h3(), tiny_inputs(1)
    _swap_ff_out(model)
    with flowlock.patch(model), pytest.raises(flowlock.StrictModeError, match=r"transformer_blocks\.1\.ff\.net\.2"):
        model(**inputs)
    with flowlock.patch(model, mode="audit") as handle:
        out = _outputs(model, inputs)
        with flowlock.mode("audit") as frame:
            _outputs(model, inputs)
    assert [f.op for f in handle.fallbacks] == ["minimax_h3 transformer_blocks.1.ff.net.2"]
    assert [f.op for f in frame.fallbacks] == ["minimax_h3 transformer_blocks.1.ff.net.2"]
    assert all(torch.isfinite(t).all() for t in out)


def test_custom_attention_processor_is_not_silently_served():
    model, inputs = tiny_h3(), tiny_inputs(1)

    class Custom(MiniMaxH3AttnProcessor):
        pass

    model.transformer_blocks[0].attn.set_processor(Custom())
    with flowlock.patch(model), pytest.raises(flowlock.StrictModeError, match=r"transformer_blocks\.0\.attn"):
        model(**inputs)


def test_lora_scale_in_attention_kwargs_is_strict_error():
    model, inputs = tiny_h3(), tiny_inputs(1)
    with flowlock.patch(model), pytest.raises(flowlock.StrictModeError, match="LoRA scale"):
        model(**inputs, attention_kwargs={"scale": 0.5})


def test_deepcopy_of_a_patched_model_runs_strict_on_its_own_weights():
    model, inputs = tiny_h3(), tiny_inputs(1)
    with flowlock.patch(model):
        clone = copy.deepcopy(model)
        with torch.no_grad():
            clone.proj_out.bias += 1.0
        with flowlock.mode("strict") as frame:
            shifted = _outputs(clone, inputs)
        base = _outputs(model, inputs)
    assert any(op == "linear" for op, _ in frame.ran)
    torch.testing.assert_close(shifted[0] - base[0], torch.ones_like(base[0]), rtol=0, atol=1e-5)
    assert_bitwise_equal(shifted[1], base[1], "audio head untouched")


def test_blocks_are_reached_through_their_hooks_and_work_alone():
    model, inputs = tiny_h3(), tiny_inputs(2)
    seen = []
    for name, module in [("norm_out", model.norm_out), ("block0", model.transformer_blocks[0]),
                         ("refiner0", model.token_refiner.refiner_blocks[0])]:
        module.register_forward_pre_hook(lambda m, args, name=name: seen.append(name))
    with flowlock.patch(model):
        _outputs(model, inputs)
        assert seen == ["refiner0", "block0", "norm_out"]
        block = model.transformer_blocks[1]
        x = torch.randn(2, 24, 64).to(torch.bfloat16)
        temb = torch.randn(2, 40)
        rope = model.rope(inputs["position_ids"])
        index = inputs["timestep_indices"] * 3 + inputs["token_tags"]
        with torch.no_grad(), flowlock.mode("strict") as frame:
            alone = block(x, temb, index, rope)
        assert ("rms_norm_modulate", "reference") in frame.ran
        with torch.no_grad(), flowlock.mode("provider"):
            stock = block(x, temb, index, rope)
        assert (alone.float() - stock.float()).abs().max() < 0.1
        with pytest.raises(ValueError, match="index"):
            block(x, temb, index + 3, rope)


def test_strict_forward_refuses_unpatched_blocks():
    from flowlock.models.minimax_h3.strict import strict_forward

    model, inputs = tiny_h3(), tiny_inputs(1)
    with pytest.raises(RuntimeError, match="flowlock.patch"):
        strict_forward(model, **inputs)


def test_return_dict_false_gives_the_tuple():
    model, inputs = tiny_h3(), tiny_inputs(1)
    with flowlock.patch(model), torch.no_grad():
        out = model(**inputs)
        plain = model(**inputs, return_dict=False)
    assert isinstance(plain, tuple)
    assert_bitwise_equal(plain, (out.sample, out.audio_sample), "tuple vs output")
