"""Trajectory artifacts: hashed round trip through safetensors + JSON, first-difference detection."""

import json

import pytest
import torch

from flowlock.rl.trajectory import Difference, Trajectory, compare, tensor_hash
from flowlock.testing import assert_bitwise_equal


def _trajectory(seed=7, sample_id=3, steps=3):
    g = torch.Generator().manual_seed(seed)
    traj = Trajectory(seed, sample_id)
    traj.set_run("sigmas.video", torch.tensor([1.0, 0.5, 0.0]))
    traj.set_run("initial.video", torch.randn(5, 4, generator=g))
    for k in range(steps):
        traj.record(k, "latent.video", torch.randn(5, 4, generator=g))
        traj.record(k, "velocity.video", torch.randn(5, 4, generator=g).bfloat16())
        traj.record(k, "log_prob", torch.randn((), generator=g))
    return traj


def test_round_trip_is_bitwise(tmp_path):
    traj = _trajectory()
    traj.save(tmp_path / "t.safetensors")
    back = Trajectory.load(tmp_path / "t.safetensors")
    assert (back.seed, back.sample_id) == (7, 3)
    assert compare(traj, back) is None
    assert back.hashes() == traj.hashes()
    for k in range(3):
        for name, t in traj.steps[k].items():
            assert_bitwise_equal(back.steps[k][name], t, name)
    meta = json.loads((tmp_path / "t.safetensors.json").read_text())
    assert meta["hashes"]["step1/log_prob"] == tensor_hash(traj.steps[1]["log_prob"])


def test_tampered_artifact_is_rejected(tmp_path):
    path = tmp_path / "t.safetensors"
    _trajectory().save(path)
    sidecar = path.with_name("t.safetensors.json")
    meta = json.loads(sidecar.read_text())
    meta["hashes"]["step2/latent.video"] = "0" * 64
    sidecar.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="step2/latent.video"):
        Trajectory.load(path)


def test_compare_finds_the_first_difference():
    a, b = _trajectory(), _trajectory()
    b.steps[2]["log_prob"] = b.steps[2]["log_prob"] + 1
    v = b.steps[1]["velocity.video"].clone()
    v[4, 3] = -v[4, 3] if v[4, 3] != 0 else 1
    b.steps[1]["velocity.video"] = v
    assert compare(a, b) == Difference(1, "velocity.video", "content differs")
    c = _trajectory()
    c.run["sigmas.video"] = torch.tensor([1.0, 0.25, 0.0])
    assert compare(a, c).step is None and compare(a, c).name == "sigmas.video"
    assert compare(a, _trajectory(steps=2)).step == 2
    assert compare(a, _trajectory(seed=8)).name == "seed"


def test_hash_covers_dtype_and_shape():
    x = torch.zeros(4, dtype=torch.float32)
    assert tensor_hash(x) != tensor_hash(x.view(torch.int32))
    assert tensor_hash(x) != tensor_hash(x.view(2, 2))
    assert tensor_hash(torch.tensor([0.0])) != tensor_hash(torch.tensor([-0.0]))
    assert tensor_hash(x) == tensor_hash(x.clone())


def test_bad_names_and_steps_raise():
    traj = Trajectory(0, 0)
    with pytest.raises(ValueError):
        traj.record(1, "x", torch.zeros(1))
    with pytest.raises(ValueError):
        traj.record(0, "a/b", torch.zeros(1))
    with pytest.raises(ValueError):
        traj.set_run("step0", torch.zeros(1))
