"""The vLLM general plugin against the real vLLM-Omni 0.30.0: with FLOWLOCK_VLLM_OMNI=strict a native H3
is on flowlock's strict path as soon as its weights are loaded (the bits of an explicit install()), once
per model however often its weights are reloaded; off, nothing changes; unregister() restores all."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from engine_inputs import ENGINE_CONFIG, make_request, native_kwargs
from vllm_omni.diffusion.models.minimax_h3.minimax_h3_transformer import MiniMaxH3DiTModel
from vllm_omni_env import build_native

import flowlock
from flowlock.integrations.vllm_omni import install, plugin
from flowlock.models.minimax_h3 import make_h3
from flowlock.testing import assert_bitwise_equal

_ORIGINAL = MiniMaxH3DiTModel.__dict__["post_load_weights"]


@pytest.fixture(autouse=True)
def _restore():
    yield
    plugin.unregister()
    assert MiniMaxH3DiTModel.__dict__["post_load_weights"] is _ORIGINAL


def _run(model, kwargs):
    with torch.no_grad():
        return model(**kwargs)


def _installed_bits(state_dict, kwargs):
    model = build_native(ENGINE_CONFIG, state_dict)
    with install(model), flowlock.mode("strict"):
        return _run(model, kwargs)


def test_switched_on_every_loaded_model_runs_strict_with_installs_bits(monkeypatch, diffusers_model):
    kwargs = native_kwargs([make_request(seed=1)])
    synced = make_h3(ENGINE_CONFIG, seed=1).state_dict()
    expected, expected_synced = _installed_bits(diffusers_model.state_dict(), kwargs), _installed_bits(synced, kwargs)
    monkeypatch.setenv(plugin.SWITCH_ENV, "strict")
    plugin.register()
    plugin.register()
    loaded = build_native(ENGINE_CONFIG, diffusers_model.state_dict())
    assert plugin.installed(loaded)
    with flowlock.mode("strict") as frame:
        got = _run(loaded, kwargs)
    assert {backend for _, backend in frame.ran} == {"reference"} and len(frame.ran) > 20
    assert_bitwise_equal(got, expected, "plugin-installed vs install()")
    # a full-weight sync loads new weights and calls post_load_weights again: one install, the new weights' bits
    loaded.load_weights(synced.items())
    loaded.post_load_weights()
    with flowlock.mode("strict"):
        assert_bitwise_equal(_run(loaded, kwargs), expected_synced, "after a weight sync")
    plugin.unregister()
    assert not plugin.installed(loaded)
    stock = build_native(ENGINE_CONFIG, synced)
    assert_bitwise_equal(_run(loaded, kwargs), _run(stock, kwargs), "after unregister()")


@pytest.mark.parametrize("value", [None, "", "off", "OFF"])
def test_switched_off_the_plugin_changes_nothing(monkeypatch, value, diffusers_model):
    if value is None:
        monkeypatch.delenv(plugin.SWITCH_ENV, raising=False)
    else:
        monkeypatch.setenv(plugin.SWITCH_ENV, value)
    plugin.register()
    assert MiniMaxH3DiTModel.__dict__["post_load_weights"] is _ORIGINAL
    assert not plugin.installed(build_native(ENGINE_CONFIG, diffusers_model.state_dict()))


def test_an_unknown_switch_value_is_refused(monkeypatch):
    monkeypatch.setenv(plugin.SWITCH_ENV, "on")
    with pytest.raises(ValueError, match="FLOWLOCK_VLLM_OMNI"):
        plugin.register()
    assert MiniMaxH3DiTModel.__dict__["post_load_weights"] is _ORIGINAL


def test_a_model_install_refuses_fails_the_load(monkeypatch, diffusers_model):
    monkeypatch.setenv(plugin.SWITCH_ENV, "strict")
    model = build_native(ENGINE_CONFIG, diffusers_model.state_dict())
    plugin.register()
    with install(model), pytest.raises(RuntimeError, match="already patched"):
        model.post_load_weights()
    assert not plugin.installed(model)


_THROUGH_VLLM = """
import vllm_omni_env
vllm_omni_env.pin_pure_python_platforms()
from vllm.plugins import load_general_plugins
from vllm_omni.diffusion.models.minimax_h3.minimax_h3_transformer import MiniMaxH3DiTModel
original = MiniMaxH3DiTModel.__dict__["post_load_weights"]
load_general_plugins()
wrapped = MiniMaxH3DiTModel.__dict__["post_load_weights"]
print("wrapped" if wrapped is not original and wrapped.__wrapped__ is original else "not wrapped")
"""


@pytest.mark.slow
def test_vllms_own_plugin_loader_runs_the_entry_point(tmp_path):
    # pyproject's [project.entry-points."vllm.general_plugins"] line, as an installed distribution's metadata
    dist = tmp_path / "flowlock_entry_point-0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: flowlock-entry-point\nVersion: 0\n")
    (dist / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nflowlock = flowlock.integrations.vllm_omni.plugin:register\n")
    tests = Path(__file__).parents[1]
    env = {**os.environ, plugin.SWITCH_ENV: "strict", "VLLM_PLUGINS": "flowlock",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(tests), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _THROUGH_VLLM], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "wrapped"


def test_importing_the_package_and_the_plugin_imports_no_engine():
    code = ("import sys, flowlock.integrations.verl_omni, flowlock.integrations.vllm_omni.plugin as p; "
            "p.register(); "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('vllm', 'vllm_omni', 'verl', 'verl_omni', 'tensordict')); assert not bad, bad")
    env = {k: v for k, v in os.environ.items() if k != plugin.SWITCH_ENV}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300)
