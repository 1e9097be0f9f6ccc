"""flowlock.ops._launch's cached-hit path, on CPU: a compiled JITFunction's launcher is faked, so the
key, the launch plan and the hit path's arguments are checked without a GPU."""

import pytest
import torch
import triton.language as tl
from launch_fakes import Compiled, Recorder, cuda_launcher
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

from flowlock.ops._launch import FastLaunch, launch_plan


def _affine(x, y, n, scale, B: tl.constexpr):
    offs = tl.program_id(0) * B + tl.arange(0, B)
    tl.store(y + offs, tl.load(x + offs, mask=offs < n) * scale, mask=offs < n)


@pytest.mark.parametrize("cooperative,pdl", [(False, False), (True, False), (False, True)])
def test_plan_calls_the_c_launch_exactly_as_the_launcher_call_does(cooperative, pdl):
    x = torch.ones(3)
    compiled = Compiled(cuda_launcher(cooperative=cooperative, pdl=pdl))
    compiled.run(5, 2, 1, 77, compiled.function, compiled.packed_metadata, None, None, None, x, 3, 2.0)
    launch, head = launch_plan(compiled)
    assert launch is compiled.run.launch
    launch(5, 2, 1, 77, *head, x, 3, 2.0)
    via_call, direct = compiled.run.launch.calls
    assert via_call == direct


@pytest.mark.parametrize("scratch", [dict(global_scratch=64), dict(profile_scratch=64)])
def test_plan_keeps_the_launcher_call_where_it_allocates_scratch(scratch):
    compiled = Compiled(cuda_launcher(**scratch))
    assert launch_plan(compiled) == (compiled.run, (0xF00, (4, 1, 0), None, None, None))


def test_plan_keeps_the_call_of_a_launcher_of_another_kind():
    compiled = Compiled(Recorder())
    launch, head = launch_plan(compiled)
    launch(1, 1, 1, 0, *head, "arg")
    assert compiled.run.calls == [(1, 1, 1, 0, 0xF00, (4, 1, 0), None, None, None, "arg")]


@pytest.fixture
def fake_cuda(monkeypatch):
    """A compiled-mode JITFunction whose compiles are recorded fakes, device 0, stream 77."""
    kernel = JITFunction(_affine)
    backend = make_backend(GPUTarget("cuda", 90, 32))
    kernel.device_caches[0] = ({}, {}, GPUTarget("cuda", 90, 32), backend,
                               create_function_from_signature(kernel.signature, kernel.params, backend))
    compiles = []

    def compile_and_launch(*args, grid, warmup, **kwargs):
        compiled = Compiled(cuda_launcher())
        compiles.append((grid, args, kwargs, compiled))
        return compiled

    monkeypatch.setattr(kernel, "run", compile_and_launch)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 77, raising=False)
    return kernel, compiles


def test_hit_launches_the_cached_kernel_with_the_bound_arguments(fake_cuda):
    kernel, compiles = fake_cuda
    wrapped = FastLaunch(kernel)
    base = torch.zeros(64)
    x, y = base[:32], base[32:]
    first = wrapped[(2,)](x, y, 32, 2.0, B=16, num_warps=4)
    assert len(compiles) == 1 and compiles[0][3] is first and not first.run.launch.calls
    again = wrapped[(3, 2)](x, y, 32, -1.5, B=16, num_warps=4)
    assert again is first and len(compiles) == 1
    assert first.run.launch.calls == [(3, 2, 1, 77, 0xF00, False, True, None, None, (4, 1, 0), None, None, None,
                                       x, y, 32, -1.5, 16)]


def test_each_specialization_compiles_once(fake_cuda):
    kernel, compiles = fake_cuda
    wrapped = FastLaunch(kernel)
    base = torch.zeros(4096 + 8)
    # n = 1, divisible by 16, odd; an aligned and a misaligned pointer; another constexpr; other options.
    calls = [((base[:1], base, 1, 2.0), dict(B=16)), ((base[:16], base, 16, 2.0), dict(B=16)),
             ((base[:17], base, 17, 2.0), dict(B=16)), ((base[1:18], base, 17, 2.0), dict(B=16)),
             ((base[:16], base, 16, 2.0), dict(B=32)), ((base[:16], base, 16, 2.0), dict(B=16, num_warps=8))]
    for _ in range(3):
        for args, kwargs in calls:
            wrapped[(1,)](*args, **kwargs)
    assert len(compiles) == len(calls) == len(wrapped._compiled)
    assert all(len(c[3].run.launch.calls) == 2 for c in compiles)


def test_a_launch_hook_or_a_callable_grid_takes_tritons_path(fake_cuda, monkeypatch):
    kernel, compiles = fake_cuda
    wrapped = FastLaunch(kernel)
    x = torch.zeros(16)
    wrapped[(1,)](x, x, 16, 2.0, B=16)
    wrapped[lambda meta: (1,)](x, x, 16, 2.0, B=16)
    monkeypatch.setattr(knobs.runtime.launch_enter_hook, "calls", [lambda metadata: None])
    wrapped[(1,)](x, x, 16, 2.0, B=16)
    assert len(compiles) == 3 and not compiles[0][3].run.launch.calls


def test_nothing_is_kept_when_triton_returns_no_kernel(fake_cuda, monkeypatch):
    kernel, compiles = fake_cuda
    wrapped = FastLaunch(kernel)
    x = torch.zeros(16)
    # What JITFunction.run returns when a jit_cache_hook takes the launch over.
    monkeypatch.setattr(kernel, "run", lambda *args, grid, warmup, **kwargs: compiles.append(grid))
    assert wrapped[(1,)](x, x, 16, 2.0, B=16) is None
    assert wrapped[(2,)](x, x, 16, 2.0, B=16) is None
    assert compiles == [(1,), (2,)] and not wrapped._compiled


def test_prepared_launch_makes_the_c_call_the_full_launch_makes(fake_cuda):
    kernel, compiles = fake_cuda
    wrapped = FastLaunch(kernel)
    x, y = torch.zeros(32), torch.zeros(32)
    assert wrapped.prepared(x, y, 32, 2.0, B=16, num_warps=4) is None  # not compiled yet
    first = wrapped[(2,)](x, y, 32, 2.0, B=16, num_warps=4)
    prepared = wrapped.prepared(x, y, 32, 2.0, B=16, num_warps=4)
    x2, y2 = torch.ones(32), torch.ones(32)
    wrapped[(3,)](x2, y2, 32, -1.5, B=16, num_warps=4)
    prepared(3, 77, x2, y2, 32, -1.5)
    via_call, via_prepared = first.run.launch.calls
    assert via_call == via_prepared and len(compiles) == 1


def test_prepared_is_for_one_specialization_and_never_under_a_hook(fake_cuda, monkeypatch):
    kernel, compiles = fake_cuda
    wrapped = FastLaunch(kernel)
    base = torch.zeros(64)
    wrapped[(1,)](base[:16], base, 16, 2.0, B=16)
    assert wrapped.prepared(base[:16], base, 16, 2.0, B=16) is not None
    assert wrapped.prepared(base[1:17], base, 16, 2.0, B=16) is None  # misaligned: another specialization
    assert wrapped.prepared(base[:16], base, 17, 2.0, B=16) is None
    assert wrapped.prepared(base[:16], base, 16, 2.0, B=32) is None
    with pytest.raises(ValueError, match="must be constexpr"):
        wrapped.prepared(base[:16], base, 16, scale=2.0, B=16)
    monkeypatch.setattr(knobs.runtime.launch_enter_hook, "calls", [lambda metadata: None])
    assert wrapped.prepared(base[:16], base, 16, 2.0, B=16) is None
