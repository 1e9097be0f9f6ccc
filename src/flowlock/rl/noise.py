"""Counter-based Gaussian noise keyed by what a sample *is*, never by where it sits in a batch.

Element ``e`` of the noise for ``(seed, sample_id, step, modality)`` is a pure function of those
five values: Philox4x32-10 with key = seed (64 bits) and counter = (e // 2, step key, sample id,
modality code) gives four 32-bit words, two 52-bit uniforms and, through Box–Muller, two normals
(cos for even ``e``, sin for odd). The transform uses only correctly rounded float64 operations
(:mod:`flowlock.rl.ieee_math`) and rounds once to float32, so CPU and GPU produce the same bits,
and any engine, batch composition or order regenerates the same noise.

Backends (:mod:`flowlock.dispatch`): on a CUDA device a draw is one Triton launch
(:mod:`flowlock.rl.noise_kernel`), elsewhere the torch spec below (about 400 small ops per draw);
``use_backend`` forces either, the Triton one on the CPU under ``TRITON_INTERPRET=1``. Both give the
same bits.

Step keys: transition ``k`` uses counter word ``k + 1``; word 0 is reserved for the initial
latents (:func:`initial_latents`), so no step can collide with them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from flowlock.dispatch import backend_for
from flowlock.rl.ieee_math import cos_sin_turns, log_f64
from flowlock.rl.noise_kernel import keyed_normal_fwd
from flowlock.rl.philox import philox4x32

MODALITY_CODES = {"video": 1, "audio": 2}
_INITIAL_STEP_KEY = 0
_MAX_U32 = 2**32 - 1
_TWO_POW_M52 = 2.0**-52


def _check_int(name: str, value: object, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise ValueError(f"{name} must lie in [{lo}, {hi}], got {value}")
    return value


def _check_modality(modality: object) -> int:
    if modality not in MODALITY_CODES:
        raise ValueError(f"modality must be one of {tuple(MODALITY_CODES)}, got {modality!r}")
    return MODALITY_CODES[modality]


def _check_shape(name: str, shape: object) -> tuple[int, ...]:
    if isinstance(shape, torch.Size):
        shape = tuple(shape)
    if not isinstance(shape, tuple) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
        raise TypeError(f"{name} must be a tuple of ints, got {shape!r}")
    if any(d < 1 for d in shape):
        raise ValueError(f"{name} must have positive dimensions, got {shape}")
    if math.prod(shape) > 2 * (_MAX_U32 + 1):
        raise ValueError(f"{name} {shape} holds more elements than one counter stream (2^33)")
    return shape


def _keyed_normal(seed: int, sample_id: int, step_key: int, code: int, shape: tuple[int, ...],
                  device: torch.device | str) -> torch.Tensor:
    numel = math.prod(shape)
    calls = torch.arange((numel + 1) // 2, dtype=torch.int64, device=device)
    w0, w1, w2, w3 = philox4x32((calls, torch.full_like(calls, step_key), torch.full_like(calls, sample_id),
                                 torch.full_like(calls, code)), (seed & _MAX_U32, seed >> 32))
    # 26 high bits of two words each -> 52-bit integers -> uniforms (k + 1/2) * 2^-52 in (0, 1), exact.
    k1 = ((w0 >> 6) << 26) | (w1 >> 6)
    k2 = ((w2 >> 6) << 26) | (w3 >> 6)
    u1 = (k1.to(torch.float64) + 0.5) * _TWO_POW_M52
    u2 = k2.to(torch.float64) * _TWO_POW_M52
    radius = torch.sqrt(log_f64(u1) * -2.0)
    cos_t, sin_t = cos_sin_turns(u2)
    pairs = torch.stack([radius * cos_t, radius * sin_t], dim=-1).reshape(-1)
    return pairs[:numel].to(torch.float32).reshape(shape)


def _draws(seed: int, sample_ids: list[int], step_key: int, code: int, shape: tuple[int, ...],
           device: torch.device | str) -> torch.Tensor:
    """``(len(sample_ids), *shape)`` float32: row ``b`` is the draw of ``sample_ids[b]``, computed by the
    backend :func:`flowlock.dispatch.backend_for` picks for ``device`` (one Triton launch per row)."""
    out = torch.empty((len(sample_ids), *shape), dtype=torch.float32, device=device)
    if backend_for("noise", out) == "triton":
        for b, sample_id in enumerate(sample_ids):
            keyed_normal_fwd(out[b], seed, sample_id, step_key, code)
    else:
        for b, sample_id in enumerate(sample_ids):
            out[b] = _keyed_normal(seed, sample_id, step_key, code, shape, out.device)
    return out


def noise(seed: int, sample_id: int, step: int, modality: str, shape: tuple[int, ...], *,
          device: torch.device | str = "cpu") -> torch.Tensor:
    """Standard-normal float32 noise of ``shape`` for transition ``step`` of one sample's modality.

    ``seed`` in [0, 2^64), ``sample_id`` in [0, 2^32), ``step`` in [0, 2^32 - 2], ``modality``
    ``"video"`` or ``"audio"``. Elements are numbered in row-major order of ``shape``, so the
    first ``n`` elements do not depend on the shape's later dimensions.
    """
    seed = _check_int("seed", seed, 0, 2**64 - 1)
    sample_id = _check_int("sample_id", sample_id, 0, _MAX_U32)
    step = _check_int("step", step, 0, _MAX_U32 - 1)
    code = _check_modality(modality)
    shape = _check_shape("shape", shape)
    return _draws(seed, [sample_id], step + 1, code, shape, device)[0]


def _check_sample_ids(sample_ids: object, batch: int) -> list[int]:
    if isinstance(sample_ids, torch.Tensor):
        if sample_ids.dtype != torch.int64 or sample_ids.ndim != 1:
            raise TypeError(f"sample_ids must be a 1-D int64 tensor, got {sample_ids.dtype} of shape "
                            f"{tuple(sample_ids.shape)}")
        ids = [int(i) for i in sample_ids.tolist()]
    elif isinstance(sample_ids, Sequence) and not isinstance(sample_ids, (str, bytes)):
        ids = list(sample_ids)
    else:
        # A single id would silently give every sample of the batch the same noise.
        raise TypeError(f"sample_ids must be a list or 1-D int64 tensor of ids, got {type(sample_ids).__name__}")
    batch = _check_int("batch", batch, 1, 2**31)
    if len(ids) != batch:
        raise ValueError(f"sample_ids holds {len(ids)} ids but the batch has {batch} samples")
    for i in ids:
        _check_int("sample_ids entry", i, 0, _MAX_U32)
    if len(set(ids)) != len(ids):
        raise ValueError(f"sample_ids must be distinct (two samples would share noise), got {ids}")
    return ids


def batch_noise(seed: int, sample_ids: Sequence[int] | torch.Tensor, step: int, modality: str,
                shape_per_sample: tuple[int, ...], *, batch: int,
                device: torch.device | str = "cpu") -> torch.Tensor:
    """``(batch, *shape_per_sample)`` float32: row ``b`` is ``noise(seed, sample_ids[b], step, ...)``.

    ``batch`` is the caller's batch size and must equal ``len(sample_ids)``; ids must be distinct.
    """
    ids = _check_sample_ids(sample_ids, batch)
    seed = _check_int("seed", seed, 0, 2**64 - 1)
    step = _check_int("step", step, 0, _MAX_U32 - 1)
    code = _check_modality(modality)
    shape = _check_shape("shape_per_sample", shape_per_sample)
    return _draws(seed, ids, step + 1, code, shape, device)


def initial_latents(seed: int, sample_ids: Sequence[int] | torch.Tensor, modality: str,
                    shape_per_sample: tuple[int, ...], *, batch: int,
                    device: torch.device | str = "cpu") -> torch.Tensor:
    """The starting latents ``x_T`` (``σ = 1``), ``(batch, *shape_per_sample)`` float32.

    Same mechanism as :func:`batch_noise` on the reserved step key, so ``x_T`` never coincides
    with the noise of any transition.
    """
    ids = _check_sample_ids(sample_ids, batch)
    seed = _check_int("seed", seed, 0, 2**64 - 1)
    code = _check_modality(modality)
    shape = _check_shape("shape_per_sample", shape_per_sample)
    return _draws(seed, ids, _INITIAL_STEP_KEY, code, shape, device)
