"""The Triton keyed-noise kernel gives the torch spec's bits: its Philox, float64 log and turn cos/sin
helpers one by one, then whole draws through ``noise`` / ``batch_noise`` / ``initial_latents``.

CPU tests run the kernel under the Triton interpreter. The GPU tests compile it and compare with the
spec on the CPU, the float64 helpers on a million inputs as well:

    TRITON_INTERPRET=0 python -m pytest -q -m gpu tests/rl/test_noise_kernel.py
"""

import math

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from flowlock.dispatch import interpreter_active, use_backend
from flowlock.modes import mode
from flowlock.rl import noise_kernel
from flowlock.rl.ieee_math import cos_sin_turns, log_f64
from flowlock.rl.noise import batch_noise, initial_latents, noise
from flowlock.rl.noise_kernel import cos_sin_turns as cos_sin_turns_jit
from flowlock.rl.noise_kernel import log_f64 as log_f64_jit
from flowlock.rl.noise_kernel import philox4x32_10
from flowlock.rl.philox import philox4x32
from flowlock.testing import assert_bitwise_equal, bitwise_equal

# Random123's known answers for Philox4x32-10: (counter, key, output).
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]
SEEDS = [0, 2**32 - 1, 2**63 - 1, 0x5DEECE66D3A4F1B7 >> 1, 2**64 - 1]
SHAPES = [(1,), (7,), (3, 96), (4097,)]
BLOCK = 128


@triton.jit
def _philox_kernel(c_ptr, k_ptr, out_ptr, BLOCK: tl.constexpr):
    # c_ptr: (4, BLOCK), k_ptr: (2, BLOCK), out_ptr: (4, BLOCK), 32-bit words in int64.
    o = tl.arange(0, BLOCK)
    c0 = tl.load(c_ptr + o).to(tl.uint32)
    c1 = tl.load(c_ptr + BLOCK + o).to(tl.uint32)
    c2 = tl.load(c_ptr + 2 * BLOCK + o).to(tl.uint32)
    c3 = tl.load(c_ptr + 3 * BLOCK + o).to(tl.uint32)
    k0 = tl.load(k_ptr + o).to(tl.uint32)
    k1 = tl.load(k_ptr + BLOCK + o).to(tl.uint32)
    w0, w1, w2, w3 = philox4x32_10(c0, c1, c2, c3, k0, k1)
    tl.store(out_ptr + o, w0.to(tl.int64))
    tl.store(out_ptr + BLOCK + o, w1.to(tl.int64))
    tl.store(out_ptr + 2 * BLOCK + o, w2.to(tl.int64))
    tl.store(out_ptr + 3 * BLOCK + o, w3.to(tl.int64))


@triton.jit
def _ieee_math_kernel(x_ptr, u_ptr, log_ptr, cos_ptr, sin_ptr, n, BLOCK: tl.constexpr):
    # All (n,) float64: log_ptr = log(x), (cos_ptr, sin_ptr) = cos/sin of the turn u.
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    tl.store(log_ptr + o, log_f64_jit(tl.load(x_ptr + o, mask=m, other=1.0)), mask=m)
    c, s = cos_sin_turns_jit(tl.load(u_ptr + o, mask=m, other=0.0))
    tl.store(cos_ptr + o, c, mask=m)
    tl.store(sin_ptr + o, s, mask=m)


def _kernel_philox(counters, keys, device="cpu"):
    """``(4, len(counters))`` Philox words through the jit helper, one lane per (counter, key) pair."""
    c = torch.zeros(4, BLOCK, dtype=torch.int64)
    k = torch.zeros(2, BLOCK, dtype=torch.int64)
    c[:, :len(counters)] = torch.tensor(counters).T
    k[:, :len(keys)] = torch.tensor(keys).T
    out = torch.zeros(4, BLOCK, dtype=torch.int64, device=device)
    _philox_kernel[(1,)](c.to(device), k.to(device), out, BLOCK=BLOCK)
    return out[:, :len(counters)].cpu()


def _kernel_math(x: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(log(x), cos(2 pi u), sin(2 pi u))`` float64 through the jit helpers, on ``x``'s device."""
    n = x.numel()
    log, cos, sin = (torch.empty_like(x) for _ in range(3))
    _ieee_math_kernel[(triton.cdiv(n, BLOCK),)](x, u, log, cos, sin, n, BLOCK=BLOCK, enable_fp_fusion=False)
    return log, cos, sin


def _math_inputs(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` random inputs plus the edges: for ``log``, the noise's extreme uniforms, both sides of the
    sqrt(2) split and values far from 1; for the turn, quarter and eighth points (signed zeros,
    the reflection's boundary) and the largest multiple of 2^-50 below 1."""
    g = torch.Generator().manual_seed(seed)
    u1 = (torch.randint(0, 2**52, (n,), generator=g).double() + 0.5) * 2.0**-52
    sqrt2 = math.sqrt(2)
    x_edges = [2.0**-53, 1 - 2.0**-53, 0.5, 1.0, 2.0, sqrt2, math.nextafter(sqrt2, 0), sqrt2 / 2,
               math.nextafter(sqrt2 / 2, 1), 3.0, 1e300, 2.0**-1022]
    u_edges = [k / 8 for k in range(8)] + [1 - 2.0**-50, 2.0**-50, 0.25 - 2.0**-50, 0.25 + 2.0**-50]
    x = torch.cat([u1, torch.tensor(x_edges, dtype=torch.float64)])
    u = torch.randint(0, 2**50, (x.numel() - len(u_edges),), generator=g).double() * 2.0**-50
    return x, torch.cat([u, torch.tensor(u_edges, dtype=torch.float64)])


def _draw(case: dict, device: str) -> torch.Tensor:
    """The case's ``(len(ids), *shape)`` draw: ``initial_latents`` for step None, else ``batch_noise``."""
    seed, ids, step, modality, shape = (case[k] for k in ("seed", "ids", "step", "modality", "shape"))
    if step is None:
        return initial_latents(seed, ids, modality, shape, batch=len(ids), device=device)
    return batch_noise(seed, ids, step, modality, shape, batch=len(ids), device=device)


# Every seed with every shape; modality, step (None: the initial latents' key) and ids rotate.
CASES = [dict(seed=seed, shape=shape, modality=("video", "audio")[(i + j) % 2], step=(None, 0, 17, 2**32 - 2)[j],
              ids=([0, 2**32 - 1], [5], [123456, 7])[(i + j) % 3])
         for i, seed in enumerate(SEEDS) for j, shape in enumerate(SHAPES)]
CASE_IDS = [f"seed{c['seed']:x}-{'x'.join(map(str, c['shape']))}-{c['modality']}-step{c['step']}" for c in CASES]


def test_philox_helper_gives_known_answers():
    out = _kernel_philox([c for c, _, _ in KAT], [k for _, k, _ in KAT])
    assert out.T.tolist() == [list(w) for _, _, w in KAT]


def test_philox_helper_equals_the_spec_on_random_words():
    g = torch.Generator().manual_seed(1)
    words = torch.randint(0, 2**32, (6, BLOCK), generator=g)
    out = _kernel_philox(words[:4].T.tolist(), words[4:].T.tolist())
    spec = [torch.cat(philox4x32(tuple(words[:4, i:i + 1]), tuple(words[4:, i].tolist()))) for i in range(BLOCK)]
    assert torch.equal(out, torch.stack(spec, 1))
    assert not torch.equal(out, torch.stack(philox4x32(tuple(words[:4]), (0, 0)))), "keys must matter"


def test_float64_helpers_equal_the_spec_bitwise():
    x, u = _math_inputs(2000, seed=2)
    log, cos, sin = _kernel_math(x, u)
    spec_cos, spec_sin = cos_sin_turns(u)
    assert_bitwise_equal((log, cos, sin), (log_f64(x), spec_cos, spec_sin), "log, cos, sin")
    # Signed zeros are part of the bits: the cosine of a quarter turn is -0.0.
    quarter = float(cos[u == 0.25])
    assert quarter == 0.0 and math.copysign(1.0, quarter) == -1.0


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_kernel_draw_equals_the_spec(case):
    spec = _draw(case, "cpu")
    with use_backend("triton"):
        got = _draw(case, "cpu")
        other = _draw({**case, "seed": case["seed"] ^ 1}, "cpu")
    assert got.shape == (len(case["ids"]), *case["shape"]) and got.dtype == torch.float32
    assert_bitwise_equal(got, spec)
    assert not bool((other == spec).any()), "another seed must give other bits"


@pytest.mark.parametrize("change", [dict(seed=(3 + 2**60) ^ 1), dict(seed=(3 + 2**60) ^ 2**40), dict(sample_id=12),
                                    dict(step=3), dict(modality="audio")],
                         ids=["seed-low-word", "seed-high-word", "sample_id", "step", "modality"])
def test_every_key_component_reaches_the_kernel(change):
    key = dict(seed=3 + 2**60, sample_id=11, step=2, modality="video")
    with use_backend("triton"):
        a = noise(**key, shape=(9,))
        b = noise(**{**key, **change}, shape=(9,))
    assert_bitwise_equal(a, noise(**key, shape=(9,)))
    assert not bool((a == b).any())


def test_noise_runs_the_spec_on_cpu_and_the_kernel_when_forced(monkeypatch):
    with mode("strict") as handle:
        noise(1, 2, 3, "video", (5,))
        with use_backend("triton"):
            noise(1, 2, 3, "video", (5,))
            initial_latents(1, [2, 4], "audio", (5,), batch=2)
    assert handle.ran == [("noise", "reference"), ("noise", "triton"), ("noise", "triton")]
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with use_backend("triton"), pytest.raises(RuntimeError, match="needs TRITON_INTERPRET=1"):
        noise(1, 2, 3, "video", (5,))


@pytest.mark.gpu
def test_cuda_float64_helpers_equal_the_cpu_spec_bitwise():
    assert isinstance(noise_kernel._keyed_normal_kernel.kernel, JITFunction) and not interpreter_active(), \
        "run with TRITON_INTERPRET=0: the interpreter would not test the compiled kernel"
    x, u = _math_inputs(1 << 20, seed=3)
    got = _kernel_math(x.cuda(), u.cuda())
    spec_cos, spec_sin = cos_sin_turns(u)
    assert_bitwise_equal(tuple(t.cpu() for t in got), (log_f64(x), spec_cos, spec_sin), "log, cos, sin")
    words = _kernel_philox([c for c, _, _ in KAT], [k for _, k, _ in KAT], "cuda")
    assert words.T.tolist() == [list(w) for _, _, w in KAT]


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES + [dict(seed=SEEDS[3], shape=(3072, 96), modality="video", step=4,
                                               ids=[0, 9, 2**31])], ids=CASE_IDS + ["3072x96"])
def test_cuda_kernel_equals_the_cpu_spec(case):
    assert not interpreter_active(), "run with TRITON_INTERPRET=0: the interpreter would not test the compiled kernel"
    spec = _draw(case, "cpu")
    with mode("strict") as handle:
        got = _draw(case, "cuda")
    assert handle.ran == [("noise", "triton")]
    assert_bitwise_equal(got.cpu(), spec)
    assert not bool((_draw({**case, "seed": case["seed"] ^ 1}, "cuda").cpu() == spec).any())
    with use_backend("reference"):
        assert bitwise_equal(_draw(case, "cuda").cpu(), spec), "the torch spec on CUDA must give the CPU's bits too"


@pytest.mark.gpu
def test_cuda_draw_is_one_launch_per_row():
    assert not interpreter_active(), "run with TRITON_INTERPRET=0: the interpreter would not test the compiled kernel"
    noise(0, 0, 0, "video", (64,), device="cuda")
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        noise(1, 2, 3, "video", (3072, 96), device="cuda")
        batch_noise(1, [4, 5, 6], 3, "audio", (100, 64), batch=3, device="cuda")
        torch.cuda.synchronize()
    # conftest poisons every torch.empty with a fill kernel; the draws launch nothing else but their own.
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
             and "FillFunctor" not in e.name]
    assert names == ["_keyed_normal_kernel"] * 4, names
