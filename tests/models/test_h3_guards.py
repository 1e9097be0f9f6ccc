"""The strict H3 path refuses, before any flowlock op runs, what it cannot run: a cast after
flowlock.patch (the tensor, its dtype and the planned one named), a model patch() cannot run (all
float16: time_embedder must be float32), a weight on another device, NaN / Inf in a sample's latents
(the tensor and the sample named, with one host read), positions outside [-2**24, 2**24] or not finite."""

import copy

import pytest
import torch

import flowlock
from flowlock.finite import check_finite_samples, nonfinite_check_enabled
from flowlock.models.minimax_h3 import tiny_h3, tiny_inputs
from flowlock.models.minimax_h3.graphed import validate_inputs
from flowlock.models.minimax_h3.positions import MAX_POSITION, check_positions

LATENTS = ("hidden_states", "audio_hidden_states", "encoder_hidden_states")


def _refused(model, inputs, error, match):
    """``model(**inputs)`` raises ``error`` matching ``match`` and runs no flowlock op first."""
    with flowlock.mode("strict") as frame, torch.no_grad(), pytest.raises(error, match=match) as raised:
        model(**inputs)
    assert frame.ran == [], f"ops ran before the error: {frame.ran[:5]}"
    return str(raised.value)


def _runs(model, inputs):
    with flowlock.mode("strict") as frame, torch.no_grad():
        out = model(**inputs)
    assert frame.fallbacks == [] and ("attention", "reference") in frame.ran
    return out


CASTS = {
    "half": (lambda m: m.half(), r"proj_in: weight is torch\.float16, but this model was patched with torch\.float32"),
    "to_bfloat16": (lambda m: m.to(torch.bfloat16),
                    r"proj_in: weight is torch\.bfloat16, but this model was patched with torch\.float32"),
    "one_block_float": (lambda m: m.transformer_blocks[1].float(),
                        r"transformer_blocks\.1\.norm1: weight is torch\.float32, but this model was patched with "
                        r"torch\.bfloat16"),
    "proj_out_bfloat16": (lambda m: m.proj_out.bfloat16(),
                          r"proj_out: weight is torch\.bfloat16, but this model was patched with torch\.float32"),
    "float": (lambda m: m.float(),
              r"context_embedder: weight is torch\.float32, but this model was patched with torch\.bfloat16"),
}


@pytest.mark.parametrize("cast", list(CASTS))
def test_a_cast_after_patching_is_refused_by_name_before_any_op(cast):
    model, inputs = tiny_h3(), tiny_inputs(2)
    handle = flowlock.patch(model)
    _runs(model, inputs)  # an accepted state first: the next call must still see the cast
    apply, match = CASTS[cast]
    apply(model)
    message = _refused(model, inputs, TypeError, match)
    assert "remove() the patch and call flowlock.patch(model) again" in message
    handle.remove()
    if cast == "float":
        # the documented remedy: a new patch plans the new dtypes, which run
        with flowlock.patch(model):
            assert _runs(model, inputs).sample.dtype == torch.float32


def test_the_remedy_for_an_unrunnable_cast_is_refused_at_patch_time():
    model = tiny_h3()
    handle = flowlock.patch(model)
    model.half()
    handle.remove()
    with pytest.raises(TypeError, match=r"time_embedder\.linear_1: weight is torch\.float16, flowlock's strict H3 "
                                        r"path needs torch\.float32 there \(timestep_mlp"):
        flowlock.patch(model)


@pytest.mark.parametrize("prepare, match", [
    (lambda m: m.half(), r"time_embedder\.linear_1: weight is torch\.float16, .* needs torch\.float32"),
    (lambda m: m.transformer_blocks[0].float(),
     r"transformer_blocks\.0\.norm1: weight is torch\.float32, .* needs torch\.bfloat16 there \(the text rows"),
    (lambda m: m.proj_out.bfloat16(), r"audio_proj_out: weight is torch\.float32, .* needs torch\.bfloat16 there "
                                      r"\(both output heads"),
    (lambda m: m.rope.double(), r"rope: inv_freq is torch\.float64, .* needs torch\.float32 / torch\.bfloat16 / "
                                r"torch\.float16"),
], ids=["all_float16", "one_block_float", "heads_differ", "rope_float64"])
def test_patch_refuses_a_model_it_cannot_run_and_patches_nothing(prepare, match):
    model = tiny_h3()
    prepare(model)
    with pytest.raises(TypeError, match=match):
        flowlock.patch(model)
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_the_dtypes_diffusers_leaves_free_patch_and_run():
    # proj_in's inputs are cast to its dtype, an AdaLN table is float32 from any weights, and the
    # positions meet a float16 inv_freq in float32: the ops run them, so patch takes them.
    model, inputs = tiny_h3(), tiny_inputs(1)
    model.proj_in.bfloat16()
    model.transformer_blocks[0].adaln_proj.float()
    model.rope.half()
    with flowlock.patch(model):
        _runs(model, inputs)


def test_a_weight_on_another_device_is_refused_by_name():
    model, inputs = tiny_h3(), tiny_inputs(1)
    flowlock.patch(model)
    model.transformer_blocks[1].ff.to("meta")
    _refused(model, inputs, ValueError, r"transformer_blocks\.1\.ff\.net\.0\.proj: weight is on meta, the inputs on "
                                        r"cpu")


def test_a_deep_copy_is_planned_at_its_first_call_and_then_refuses_casts():
    model, inputs = tiny_h3(), tiny_inputs(1)
    flowlock.patch(model)
    clone = copy.deepcopy(model)
    _runs(clone, inputs)
    clone.float()
    _refused(clone, inputs, TypeError, r"context_embedder: weight is torch\.float32, but this model was patched")
    _runs(model, inputs)  # the original is untouched by its copy's cast


@pytest.mark.parametrize("latent", LATENTS)
@pytest.mark.parametrize("value, kind", [(float("nan"), "NaN"), (float("inf"), "Inf"), (-float("inf"), "Inf")])
def test_a_non_finite_latent_is_refused_naming_the_tensor_and_the_sample(latent, value, kind):
    model, inputs = tiny_h3(), tiny_inputs(2)
    flowlock.patch(model)
    inputs[latent] = inputs[latent].clone()
    inputs[latent][1, 2, 3] = value
    _refused(model, inputs, ValueError, rf"{latent} holds {kind} in sample 1 \(first at index \(2, 3\) of that sample")


def test_the_switch_lets_non_finite_latents_through_and_restores():
    model, inputs = tiny_h3(), tiny_inputs(2)
    flowlock.patch(model)
    inputs["hidden_states"] = inputs["hidden_states"].clone()
    inputs["hidden_states"][1, 0, 0] = float("nan")
    with flowlock.nonfinite_check(False):
        with flowlock.nonfinite_check(True):
            assert nonfinite_check_enabled()
        assert not nonfinite_check_enabled()
        out = _runs(model, inputs)
    assert nonfinite_check_enabled()
    # batch invariance keeps sample 0 clean; sample 1 is garbage, which is why the check is on by default
    assert torch.isfinite(out.sample[0]).all() and not torch.isfinite(out.sample[1]).all()
    with pytest.raises(TypeError, match="enabled must be a bool"):
        with flowlock.nonfinite_check("off"):
            pass


def test_the_non_finite_check_reads_the_host_once(monkeypatch):
    tensors = [(n, t) for n, t in tiny_inputs(3).items() if n in LATENTS]
    reads = []
    for method in ("tolist", "item", "__bool__"):
        original = getattr(torch.Tensor, method)
        monkeypatch.setattr(torch.Tensor, method,
                            lambda self, *a, _o=original, _m=method: (reads.append(_m), _o(self, *a))[1])
    check_finite_samples(tensors)
    assert reads == ["tolist"]


def test_graphed_replays_check_the_latents_too():
    inputs = tiny_inputs(2)
    inputs["audio_hidden_states"] = inputs["audio_hidden_states"].clone()
    inputs["audio_hidden_states"][1, 0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"audio_hidden_states holds Inf in sample 1"):
        validate_inputs(inputs)


@pytest.mark.parametrize("row, value", [(0, -(MAX_POSITION + 1)), (5, 10 ** 9), (6, MAX_POSITION + 1)])
def test_positions_out_of_range_are_refused_before_any_op(row, value):
    model, inputs = tiny_h3(), tiny_inputs(1)
    flowlock.patch(model)
    inputs["position_ids"] = inputs["position_ids"].clone()
    inputs["position_ids"][row, 1] = value
    _refused(model, inputs, ValueError,
             rf"position_ids must be finite and lie in \[-{MAX_POSITION}, {MAX_POSITION}\]: RoPE .*; found {value}$")


def test_the_position_bound_is_inclusive_and_covers_negative_and_float_positions():
    # vLLM-Omni's keyframe (FL2VA) packing places condition rows at negative, fractional positions
    check_positions(torch.tensor([[0, -MAX_POSITION, MAX_POSITION]]), eager=True)
    check_positions(torch.tensor([[0.0, -3.5959, 6.6667]], dtype=torch.float64), eager=True)
    for bad in (float("nan"), float("-inf"), float("inf"), MAX_POSITION + 0.5):
        with pytest.raises(ValueError, match="position_ids must be finite and lie in"):
            check_positions(torch.tensor([[0.0, bad, 1.0]], dtype=torch.float64), eager=True)
