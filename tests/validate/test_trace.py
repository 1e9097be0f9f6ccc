"""The first-divergence trace finds a planted divergence at the right module, and none without it."""

import pytest
import torch
from torch import nn

from flowlock.models.minimax_h3.tiny import tiny_h3, tiny_inputs
from flowlock.validate.trace import Record, capture, first_divergence, trace


class _Elementwise(nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, x):
        return torch.tanh(x * self.scale)


class _BatchDependent(nn.Module):
    """Planted non-invariance: the output shifts when the batch holds more than one sample."""

    def forward(self, x):
        return x + (x.shape[0] > 1) * 1e-3


def _toy(planted: bool) -> nn.Module:
    middle = _BatchDependent() if planted else nn.Identity()
    return nn.Sequential(_Elementwise(0.5), nn.Sequential(_Elementwise(2.0), middle), _Elementwise(1.5))


def test_alone_vs_batched_finds_planted_module():
    x = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(0))
    model = _toy(planted=True)
    report = trace(model, lambda: model(x[1:2]), lambda: model(x), batch_a=1, batch_b=3, sample_a=0, sample_b=1)
    div = report["divergence"]
    assert div is not None and div["module"] == "1.1" and div["kind"] == "values"
    assert div["mismatches"] == 35 and div["numel"] == 35
    assert div["max_abs_diff"] == pytest.approx(1e-3, rel=1e-3)
    assert report["output_differs"]


def test_a_divergence_erased_before_the_output_is_reported_as_such():
    """The planted difference is multiplied by zero by the last module: found inside, absent at the output."""
    x = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(0))
    model = nn.Sequential(_Elementwise(0.5), _BatchDependent(), _Elementwise(0.0))
    report = trace(model, lambda: model(x[1:2]), lambda: model(x), batch_a=1, batch_b=3, sample_a=0, sample_b=1)
    assert report["divergence"]["module"] == "1"
    assert not report["output_differs"]


def test_alone_vs_batched_clean_model_has_no_divergence():
    x = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(0))
    model = _toy(planted=False)
    report = trace(model, lambda: model(x[2:3]), lambda: model(x), batch_a=1, batch_b=3, sample_a=0, sample_b=2)
    assert report["divergence"] is None and not report["output_differs"]
    assert report["records"] == 6


def test_unbatched_outputs_are_compared_whole():
    """A (T, C) tensor that is not batched is compared whole even when T equals neither batch."""
    table = torch.randn(2, 4)
    rec_a = capture(nn.Identity(), lambda: None)
    assert rec_a == []
    a = [Record("emb", (table,))]
    b = [Record("emb", (table.clone(),))]
    assert first_divergence(a, b, batch_a=1, batch_b=3) is None
    b[0].outputs[0][1, 3] += 1.0
    div = first_divergence(a, b, batch_a=1, batch_b=3)
    assert div.module == "emb" and div.mismatches == 1


def test_structure_mismatch_is_reported():
    a = [Record("x", (torch.zeros(2, 3),))]
    b = [Record("y", (torch.zeros(2, 3),))]
    assert first_divergence(a, b, batch_a=2, batch_b=2).kind == "structure"
    assert first_divergence(a, [], batch_a=2, batch_b=2).kind == "structure"


def test_tiny_h3_planted_divergence_found_at_module():
    """Same batch twice; a hook perturbs one submodule's output in the second run only."""
    model = tiny_h3()
    inputs = tiny_inputs(2, seed=3)
    armed = {"on": False}

    def plant(module, args, output):
        return output + 1e-2 if armed["on"] else None

    def run_b():
        armed["on"] = True
        try:
            return model(**inputs)
        finally:
            armed["on"] = False

    handle = model.transformer_blocks[1].attn.to_out[0].register_forward_hook(plant)
    try:
        clean = trace(model, lambda: model(**inputs), lambda: model(**inputs), batch_a=2, batch_b=2)
        planted = trace(model, lambda: model(**inputs), run_b, batch_a=2, batch_b=2)
    finally:
        handle.remove()
    assert clean["divergence"] is None
    assert planted["divergence"]["module"] == "transformer_blocks.1.attn.to_out.0"
    assert planted["records"] == clean["records"]
