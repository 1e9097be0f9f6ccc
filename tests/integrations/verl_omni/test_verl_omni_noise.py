"""A rollout request's keyed SDE noise: the same bits drawn alone or packed with other requests, in any
order and at any step order; the record's keys regenerate them; bad keys are refused."""

import pytest
import torch
from tensordict import TensorDict

from flowlock.integrations.verl_omni import RequestNoise, packed_step_noise
from flowlock.rl import noise

WIDTHS = (96, 32)
REQUESTS = [(RequestNoise(11, 0), 12, 8), (RequestNoise(11, 1), 20, 6), (RequestNoise(2**63 - 1, 7), 5, 16)]


def _split(rows, counts):
    return list(torch.split(rows, counts))


def _request_rows(pack, step, draw=packed_step_noise):
    keys, nv, na = (list(x) for x in zip(*pack))
    video, audio = draw(keys, step, nv, na, WIDTHS)
    return {k: (v, a) for k, v, a in zip(keys, _split(video, nv), _split(audio, na))}


def _differences(pack, step, draw=packed_step_noise):
    """The requests of ``pack`` whose packed rows differ from ``draw``'s rows for them alone."""
    packed = _request_rows(pack, step, draw)
    alone = {key: _request_rows([(key, nv, na)], step, draw)[key] for key, nv, na in pack}
    return [key for key, _, _ in pack if not all(torch.equal(p, a) for p, a in zip(packed[key], alone[key]))]


def test_a_step_is_the_same_bits_alone_and_packed_in_any_order():
    for step in (3, 0, 1):
        for pack in (REQUESTS, REQUESTS[::-1], [REQUESTS[2], REQUESTS[0]]):
            assert _differences(pack, step) == []
    for key, nv, na in REQUESTS:
        alone = _request_rows([(key, nv, na)], 1)[key]
        assert all(torch.equal(a, b) for a, b in zip(alone, key.step(1, (nv, WIDTHS[0]), (na, WIDTHS[1]))))


def _one_generator_for_the_pack(keys, step, video_rows, audio_rows, widths):
    """The planted non-invariant draw: one generator for the whole pack, requests drawn in pack order."""
    gen = torch.Generator().manual_seed(step)
    return (torch.cat([torch.randn(n, widths[0], generator=gen) for n in video_rows]),
            torch.cat([torch.randn(n, widths[1], generator=gen) for n in audio_rows]))


def test_the_comparison_catches_a_draw_shared_by_the_pack():
    assert _differences(REQUESTS[::-1], 2, _one_generator_for_the_pack) != []


def test_the_draw_is_flowlocks_keyed_noise_and_distinct_per_key_step_and_modality():
    key = RequestNoise(5, 3)
    video, audio = key.step(4, (6, 96), (2, 32))
    assert video.dtype == audio.dtype == torch.float32
    assert torch.equal(video, noise(5, 3, 4, "video", (6, 96)))
    assert torch.equal(audio, noise(5, 3, 4, "audio", (2, 32)))
    others = [RequestNoise(5, 4).step(4, (6, 96), (2, 32))[0], RequestNoise(6, 3).step(4, (6, 96), (2, 32))[0],
              key.step(5, (6, 96), (2, 32))[0]]
    assert all(not torch.equal(video, o) for o in others)
    assert not torch.equal(video[:2, :32], audio)


def test_the_record_keys_regenerate_the_requests_noise():
    keys = [key for key, _, _ in REQUESTS]
    records = [k.record() for k in keys]
    batch = TensorDict({f: torch.cat([r[f] for r in records]) for f in records[0]}, batch_size=[len(keys)])
    for index, key in enumerate(keys):
        assert RequestNoise.from_record(batch[[2, 0, 1]], [2, 0, 1].index(index)) == key
    with pytest.raises(KeyError, match="flowlock_noise_seed"):
        RequestNoise.from_record(batch.exclude("flowlock_noise_seed"), 0)
    with pytest.raises(TypeError, match="flowlock_noise_sample_id"):
        RequestNoise.from_record(TensorDict({"flowlock_noise_seed": batch["flowlock_noise_seed"],
                                             "flowlock_noise_sample_id": batch["flowlock_noise_sample_id"].int()},
                                            batch_size=[3]), 0)
    with pytest.raises(ValueError, match="index"):
        RequestNoise.from_record(batch, 3)


def test_bad_keys_and_packs_are_refused():
    with pytest.raises(ValueError, match="seed"):
        RequestNoise(2**63, 0)
    with pytest.raises(ValueError, match="sample_id"):
        RequestNoise(0, 2**32)
    with pytest.raises(TypeError, match="seed"):
        RequestNoise(1.0, 0)
    key = RequestNoise(1, 1)
    with pytest.raises(ValueError, match="distinct"):
        packed_step_noise([key, RequestNoise(1, 1)], 0, [2, 2], [1, 1], WIDTHS)
    with pytest.raises(ValueError, match="one row count per request"):
        packed_step_noise([key], 0, [2, 2], [1], WIDTHS)
    with pytest.raises(TypeError, match="RequestNoise"):
        packed_step_noise([(1, 1)], 0, [2], [1], WIDTHS)
