"""The generic reversible patch machinery: exact names, atomic apply, restore by identity."""

import copy

import pytest
import torch
from torch import nn

from flowlock.patching import REPLACEMENT_MARK, PatchEntry, PatchHandle, apply_plan


def _model():
    return nn.Sequential(*[nn.Linear(2, 2) for _ in range(11)])


def _marker(*args):
    return "patched"


def test_exact_qualified_names_only():
    model = _model()
    handle = apply_plan(model, [PatchEntry("1", "forward", _marker, nn.Linear)], PatchHandle("strict"))
    assert model[1](torch.zeros(2)) == "patched"
    assert "forward" not in model[10].__dict__  # "1" is a prefix of "10": never matched
    assert handle.patched == [("1", "forward")]
    handle.remove()
    assert "forward" not in model[1].__dict__


def test_bad_plan_changes_nothing():
    model = _model()
    plan = [PatchEntry("0", "forward", _marker), PatchEntry("2", "forward", _marker, nn.ReLU)]
    with pytest.raises(TypeError, match="ReLU"):
        apply_plan(model, plan, PatchHandle("strict"))
    assert "forward" not in model[0].__dict__
    with pytest.raises(AttributeError):
        apply_plan(model, [PatchEntry("missing", "forward", _marker)], PatchHandle("strict"))


@pytest.mark.parametrize("attribute", ["weight", "bias"])
def test_parameters_are_never_patched(attribute):
    model = _model()
    with pytest.raises(TypeError, match="parameter"):
        apply_plan(model, [PatchEntry("0", attribute, _marker)], PatchHandle("strict"))


def test_instance_attribute_restored_by_identity_and_double_patch_refused():
    model = _model()
    own = model[3].forward
    model[3].forward = own
    handle = apply_plan(model, [PatchEntry("3", "forward", _marker)], PatchHandle("strict"))
    with pytest.raises(RuntimeError, match="already patched"):
        apply_plan(model, [PatchEntry("3", "forward", _marker)], PatchHandle("strict"))
    handle.remove()
    assert model[3].__dict__["forward"] is own
    with pytest.raises(RuntimeError, match="already removed"):
        handle.remove()
    apply_plan(model, [PatchEntry("3", "forward", _marker)], PatchHandle("strict")).remove()


def test_a_marked_replacement_no_handle_owns_is_refused():
    def replacement(*args):
        return "patched"

    setattr(replacement, REPLACEMENT_MARK, True)
    model = _model()
    apply_plan(model, [PatchEntry("4", "forward", replacement)], PatchHandle("strict"))
    clone = copy.deepcopy(model)  # holds the replacement, registered with no handle
    with pytest.raises(RuntimeError, match="copy of a patched model"):
        apply_plan(clone, [PatchEntry("4", "forward", _marker)], PatchHandle("strict"))
    assert clone[4].__dict__["forward"] is replacement
    apply_plan(clone, [PatchEntry("5", "forward", _marker)], PatchHandle("strict")).remove()


def test_live_patches_keep_inductor_rounding_like_eager_and_removal_restores_the_flag():
    from torch._inductor import config

    before = config.emulate_precision_casts
    first = apply_plan(_model(), [PatchEntry("0", "forward", _marker)], PatchHandle("strict"))
    second = apply_plan(_model(), [PatchEntry("0", "forward", _marker)], PatchHandle("strict"))
    assert config.emulate_precision_casts is True
    first.remove()
    assert config.emulate_precision_casts is True  # the second patch is still live
    second.remove()
    assert config.emulate_precision_casts is before
