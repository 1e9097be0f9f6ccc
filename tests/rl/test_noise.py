"""Keyed counter-based noise: Philox known answers, keying, batch independence, device-free math."""

import math

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st

from flowlock.rl.ieee_math import cos_sin_turns, log_f64
from flowlock.rl.noise import batch_noise, initial_latents, noise
from flowlock.rl.philox import philox4x32
from flowlock.testing import assert_bitwise_equal, bitwise_equal

SHAPE = (7, 5)

# Known-answer vectors of Philox4x32-10 from the Random123 distribution (kat_vectors).
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter, key, expected", KAT)
def test_philox_known_answers(counter, key, expected):
    out = philox4x32(tuple(torch.tensor([c]) for c in counter), key)
    assert tuple(int(w) for w in out) == expected


@triton.jit
def _triton_philox_kernel(out_ptr, c0_ptr, seed, c1, c2, c3, n: tl.constexpr):
    offs = tl.arange(0, n)
    c0 = tl.load(c0_ptr + offs)
    zero = c0 * 0
    w0, w1, w2, w3 = tl.philox(seed, c0, zero + c1, zero + c2, zero + c3, 10)
    tl.store(out_ptr + offs * 4, w0)
    tl.store(out_ptr + offs * 4 + 1, w1)
    tl.store(out_ptr + offs * 4 + 2, w2)
    tl.store(out_ptr + offs * 4 + 3, w3)


def test_philox_agrees_with_triton():
    # An independent implementation: Triton's own Philox4x32-10 (key = seed low/high words).
    n, seed, c1, c2, c3 = 32, 0x0123456789AB, 5, 7, 2
    c0 = torch.arange(n, dtype=torch.int32) * 977
    out = torch.zeros(n * 4, dtype=torch.int32)
    _triton_philox_kernel[(1,)](out, c0, seed, c1, c2, c3, n=n)
    full = lambda v: torch.full((n,), v, dtype=torch.int64)
    mine = philox4x32((c0.long(), full(c1), full(c2), full(c3)), (seed & 0xFFFFFFFF, seed >> 32))
    assert torch.equal(out.long() & 0xFFFFFFFF, torch.stack(mine, 1).reshape(-1))


def test_same_key_same_bits_and_float32():
    a = noise(3, 11, 2, "video", SHAPE)
    assert a.dtype == torch.float32 and a.shape == SHAPE
    assert_bitwise_equal(a, noise(3, 11, 2, "video", SHAPE))


@pytest.mark.parametrize("other", [
    dict(seed=4), dict(sample_id=12), dict(step=3), dict(modality="audio"),
])
def test_every_key_component_changes_the_noise(other):
    key = dict(seed=3, sample_id=11, step=2, modality="video")
    a = noise(**key, shape=SHAPE)
    b = noise(**{**key, **other}, shape=SHAPE)
    assert not bool((a == b).any())


def test_initial_latents_differ_from_every_step():
    x_t = initial_latents(5, [0], "video", SHAPE, batch=1)[0]
    for step in range(4):
        assert not bool((x_t == noise(5, 0, step, "video", SHAPE)).any())


def test_elements_are_numbered_row_major_independent_of_shape():
    flat = noise(1, 2, 0, "audio", (35,))
    assert_bitwise_equal(noise(1, 2, 0, "audio", (5, 7)).reshape(-1), flat)
    assert_bitwise_equal(noise(1, 2, 0, "audio", (40,))[:35], flat)


@settings(max_examples=20, deadline=None)
@given(ids=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=6, unique=True),
       seed=st.integers(0, 2**64 - 1), step=st.integers(0, 1000), data=st.data())
def test_batch_noise_is_independent_of_batch_composition_and_order(ids, seed, step, data):
    order = data.draw(st.permutations(ids))
    a = batch_noise(seed, ids, step, "video", SHAPE, batch=len(ids))
    b = batch_noise(seed, torch.tensor(order, dtype=torch.int64), step, "video", SHAPE, batch=len(order))
    for i, sid in enumerate(ids):
        alone = noise(seed, sid, step, "video", SHAPE)
        assert_bitwise_equal(a[i], alone)
        assert_bitwise_equal(b[order.index(sid)], alone)


def test_distribution_is_standard_normal():
    z = noise(123, 7, 0, "video", (400_000,)).double()
    n = z.numel()
    assert abs(z.mean().item()) < 5 / math.sqrt(n)
    assert abs(z.var().item() - 1) < 5 * math.sqrt(2 / n)
    # Empirical CDF against Phi at a few points (Kolmogorov-style bound, generous).
    for x in (-3.0, -1.0, 0.0, 0.5, 2.0):
        phi = 0.5 * (1 + math.erf(x / math.sqrt(2)))
        assert abs((z <= x).double().mean().item() - phi) < 5 / math.sqrt(n)
    assert z.abs().max().item() < 7.0


def test_ieee_log_and_turn_sincos_accuracy():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(20_000, generator=g, dtype=torch.float64) * 1e3 + 2.0**-1000
    x = torch.cat([x, torch.tensor([2.0**-52, 0.5, 1.0, 2.0, 1 - 2.0**-52, math.sqrt(2)], dtype=torch.float64)])
    rel = ((log_f64(x) - torch.log(x)).abs() / torch.log(x).abs().clamp(min=1e-300)).max().item()
    assert rel < 1e-15
    u = torch.randint(0, 2**50, (20_000,), generator=g).to(torch.float64) * 2.0**-50
    u = torch.cat([u, torch.tensor([0.0, 0.25, 0.5, 0.75, 0.125, 1 - 2.0**-50], dtype=torch.float64)])
    c, s = cos_sin_turns(u)
    assert (c - torch.cos(2 * math.pi * u)).abs().max().item() < 2e-15
    assert (s - torch.sin(2 * math.pi * u)).abs().max().item() < 2e-15


@pytest.mark.gpu
def test_same_bits_on_cuda_and_cpu():
    ids = [0, 1, 2**32 - 1]
    cpu = batch_noise(2**63 + 5, ids, 17, "audio", (129, 33), batch=3)
    gpu = batch_noise(2**63 + 5, ids, 17, "audio", (129, 33), batch=3, device="cuda")
    assert_bitwise_equal(gpu.cpu(), cpu)
    assert bitwise_equal(initial_latents(9, ids, "video", (64,), batch=3, device="cuda").cpu(),
                         initial_latents(9, ids, "video", (64,), batch=3))


@pytest.mark.parametrize("call, error", [
    (lambda: noise(0, 0, 0, "text", SHAPE), ValueError),
    (lambda: noise(-1, 0, 0, "video", SHAPE), ValueError),
    (lambda: noise(2**64, 0, 0, "video", SHAPE), ValueError),
    (lambda: noise(0, 2**32, 0, "video", SHAPE), ValueError),
    (lambda: noise(0, 0, -1, "video", SHAPE), ValueError),
    (lambda: noise(0, 0, 0.0, "video", SHAPE), TypeError),
    (lambda: noise(0, 0, 0, "video", (3, 0)), ValueError),
    (lambda: noise(0, 0, 0, "video", [3, 4]), TypeError),
    (lambda: batch_noise(0, 5, 0, "video", SHAPE, batch=4), TypeError),
    (lambda: batch_noise(0, [5], 0, "video", SHAPE, batch=4), ValueError),
    (lambda: batch_noise(0, [1, 2, 3], 0, "video", SHAPE, batch=4), ValueError),
    (lambda: batch_noise(0, [1, 1], 0, "video", SHAPE, batch=2), ValueError),
    (lambda: batch_noise(0, torch.tensor([1, 2], dtype=torch.int32), 0, "video", SHAPE, batch=2), TypeError),
    (lambda: batch_noise(0, [1, 2], 0, "audio2", SHAPE, batch=2), ValueError),
    (lambda: initial_latents(0, [1, 2], "video", SHAPE, batch=3), ValueError),
])
def test_bad_inputs(call, error):
    with pytest.raises(error):
        call()


def test_sample_id_tensor_is_not_modified():
    ids = torch.tensor([4, 2], dtype=torch.int64)
    with pytest.raises(ValueError):
        batch_noise(0, ids, 0, "video", SHAPE, batch=3)
    assert ids.tolist() == [4, 2]
