"""The SDE noise of one H3 rollout request, keyed instead of drawn from a shared generator.

verl-omni's rollout gives each request ``torch.Generator(device).manual_seed(seed + 1)`` and draws
video then audio noise from it at every grid step, so a request's noise depends on the device's
generator and on every draw before it. Here a request's noise for grid step ``k`` is
``flowlock.rl.noise(seed, sample_id, k, modality, (rows, width))``: a pure function of the key, the
same bits on any device, for any step order, with or without the steps before it (an η = 0 step
needs no draw at all), alone or packed with other requests.

:class:`RequestNoise` is what the rollout adapter holds per request; :meth:`RequestNoise.record`
gives the record fields that let the actor (or a trace) regenerate the same bits, and
:meth:`RequestNoise.from_record` reads them back. :func:`packed_step_noise` draws one step for
several requests packed into one forward, row-concatenated in the pack's order, as vLLM-Omni
concatenates their video rows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from flowlock.ops._validate import check_tensor
from flowlock.rl.noise import noise

SEED_KEY = "flowlock_noise_seed"
SAMPLE_ID_KEY = "flowlock_noise_sample_id"
# The record stores keys as int64, so the seed is limited to [0, 2^63) (verl-omni's row seeds are
# reduced mod 2^63 - 1).
_MAX_SEED = 2**63 - 1
_MAX_SAMPLE_ID = 2**32 - 1


def _check_key(name: str, value: object, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not 0 <= value <= hi:
        raise ValueError(f"{name} must lie in [0, {hi}], got {value}")
    return value


@dataclass(frozen=True)
class RequestNoise:
    """The noise key of one request: ``seed`` in [0, 2^63), ``sample_id`` in [0, 2^32).

    Two requests of one rollout must differ in ``(seed, sample_id)``, or they draw the same noise.
    """

    seed: int
    sample_id: int

    def __post_init__(self):
        _check_key("seed", self.seed, _MAX_SEED)
        _check_key("sample_id", self.sample_id, _MAX_SAMPLE_ID)

    def step(self, grid_step: int, video_shape: tuple[int, int], audio_shape: tuple[int, int], *,
             device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """Standard-normal float32 noise ``(video (Nv, Cv), audio (Na, Ca))`` of grid step ``grid_step``
        (the index ``h3_step_indices`` records), for the rows the sampler steps."""
        return (noise(self.seed, self.sample_id, grid_step, "video", tuple(video_shape), device=device),
                noise(self.seed, self.sample_id, grid_step, "audio", tuple(audio_shape), device=device))

    def record(self) -> dict[str, torch.Tensor]:
        """The record fields of this request (batch 1, int64), stacked by the trainer like every field."""
        return {SEED_KEY: torch.tensor([self.seed], dtype=torch.int64),
                SAMPLE_ID_KEY: torch.tensor([self.sample_id], dtype=torch.int64)}

    @classmethod
    def from_record(cls, record: Mapping, index: int) -> RequestNoise:
        """The key of request ``index`` of a record holding the fields :meth:`record` wrote."""
        values = []
        for key in (SEED_KEY, SAMPLE_ID_KEY):
            if key not in record.keys():
                raise KeyError(f"the rollout record has no field {key!r}: it was not drawn by flowlock's keyed noise")
            field = check_tensor(f"record[{key!r}]", record[key], dtypes=(torch.int64,), ndim=1)
            if not 0 <= index < field.shape[0]:
                raise ValueError(f"index must lie in [0, {field.shape[0]}), got {index}")
            values.append(int(field[index]))
        return cls(*values)


def packed_step_noise(requests: Sequence[RequestNoise], grid_step: int, video_rows: Sequence[int],
                      audio_rows: Sequence[int], row_widths: tuple[int, int], *,
                      device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Grid step ``grid_step``'s noise of requests packed into one forward, in pack order:
    ``(video (ΣNv, Cv), audio (ΣNa, Ca))`` float32, request ``i``'s rows being exactly
    ``requests[i].step(...)``'s. Keys must be distinct.
    """
    n = len(requests)
    if n < 1 or not all(isinstance(r, RequestNoise) for r in requests):
        raise TypeError("requests must be a non-empty sequence of RequestNoise")
    if len(set(requests)) != n:
        raise ValueError("requests must have distinct (seed, sample_id) keys: two would share their noise")
    if len(video_rows) != n or len(audio_rows) != n:
        raise ValueError(f"video_rows and audio_rows must give one row count per request ({n}), got "
                         f"{len(video_rows)} and {len(audio_rows)}")
    cv, ca = row_widths
    draws = [r.step(grid_step, (nv, cv), (na, ca), device=device) for r, nv, na in zip(requests, video_rows,
                                                                                       audio_rows)]
    return torch.cat([v for v, _ in draws]), torch.cat([a for _, a in draws])
