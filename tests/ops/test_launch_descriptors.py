"""flowlock.ops._launch's DescriptorLaunch, on CPU: Triton's own descriptor wrapper and binder around a
recorded C launch and a fake tensor-map encoder, so the relaunch is checked against the C call Triton's
launch makes, argument for argument, and the encodings it keeps are counted."""

import pytest
import torch
import triton
import triton.language as tl
from launch_fakes import Compiled, Recorder, cuda_launcher
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.driver import wrap_handle_tensordesc
from triton.compiler import make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature
from triton.tools.tensor_descriptor import TensorDescriptor

from flowlock.ops._launch import DescriptorLaunch, FastLaunch, _c_launch_below_descriptor_wrapper


def _copy(a_desc, b_desc, n, scale, B: tl.constexpr):
    b_desc.store([0, 0], a_desc.load([0, 0]) * scale)


def _copy_late(n, a_desc, b_desc, scale, B: tl.constexpr):
    b_desc.store([0, 0], a_desc.load([0, 0]) * scale)


_SIGNATURE = {"a_desc": "tensordesc<fp32[8, 16]>", "b_desc": "tensordesc<fp32[8, 16]>", "n": "i32",
              "scale": "fp32", "B": "constexpr"}
_META = dict(swizzle=3, elem_size=4, elem_type=7, block_size=[8, 16], fp4_padded=False)


class _Encoder:
    """fill_tma_descriptor's stand-in: the 'map' is its arguments, so equal maps mean equal encodings."""

    def __init__(self):
        self.calls = 0

    def fill_tma_descriptor(self, *args):
        self.calls += 1
        return ("map", args[0], args[1], args[2], args[3], tuple(args[4]), tuple(args[5]), tuple(args[6]), args[7])


class _Driver:
    def __init__(self, encoder):
        self.utils = encoder


@pytest.fixture
def fake_tma(monkeypatch):
    return _fake_tma(monkeypatch, _copy)


def _fake_tma(monkeypatch, fn):
    """A compiled-mode kernel whose one compile is a CUDA launcher with Triton's descriptor wrapper over
    a recorded C launch; tensor maps come from a counting fake encoder."""
    kernel = JITFunction(fn)
    backend = make_backend(GPUTarget("cuda", 90, 32))
    kernel.device_caches[0] = ({}, {}, GPUTarget("cuda", 90, 32), backend,
                               create_function_from_signature(kernel.signature, kernel.params, backend))
    encoder = _Encoder()
    monkeypatch.setattr(triton.runtime.driver, "_active", _Driver(encoder))
    c_launch = Recorder()
    compiles = []

    def compile_and_launch(*args, grid, warmup, **kwargs):
        launcher = cuda_launcher()
        launcher.launch = wrap_handle_tensordesc(c_launch, _SIGNATURE, [_META, _META])
        compiled = Compiled(launcher)
        compiled.metadata = type("Metadata", (), {"tensordesc_meta": [_META, _META]})()
        compiles.append(compiled)
        return compiled

    monkeypatch.setattr(kernel, "run", compile_and_launch)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 77, raising=False)
    return kernel, compiles, c_launch, encoder


def _descs(a, b):
    return TensorDescriptor.from_tensor(a, [8, 16]), TensorDescriptor.from_tensor(b, [8, 16])


def test_the_wrapper_is_unwrapped_to_the_c_launch():
    c_launch = Recorder()
    launcher = cuda_launcher()
    launcher.launch = wrap_handle_tensordesc(c_launch, _SIGNATURE, [_META, _META])
    assert _c_launch_below_descriptor_wrapper(launcher) is c_launch
    assert _c_launch_below_descriptor_wrapper(cuda_launcher()) is None  # no descriptor wrapper
    assert _c_launch_below_descriptor_wrapper(cuda_launcher(global_scratch=64)) is None
    assert _c_launch_below_descriptor_wrapper(Recorder()) is None


def test_relaunch_makes_the_c_call_tritons_launch_makes(fake_tma):
    kernel, compiles, c_launch, encoder = fake_tma
    wrapped = FastLaunch(kernel)
    a, b = torch.zeros(16, 32), torch.zeros(16, 32)
    assert wrapped.prepared(*_descs(a, b), 16, 2.0, B=16, num_warps=4) is None  # not compiled yet
    wrapped[(2,)](*_descs(a, b), 16, 2.0, B=16, num_warps=4)
    prepared = wrapped.prepared(*_descs(a, b), 16, 2.0, B=16, num_warps=4)
    assert isinstance(prepared, DescriptorLaunch) and len(compiles) == 1
    a2, b2 = torch.ones(16, 32), torch.ones(16, 32)
    c_launch.calls.clear()
    wrapped[(3,)](*_descs(a2, b2), 16, -1.5, B=16, num_warps=4)
    prepared(3, 77, a2, b2, 16, -1.5)
    via_triton, via_prepared = c_launch.calls
    assert via_triton == via_prepared
    assert via_prepared[13] == ("map", a2.data_ptr(), 3, 4, 7, (8, 16), (16, 32), (32, 1), 0)


def test_each_address_is_encoded_once(fake_tma):
    kernel, _, c_launch, encoder = fake_tma
    wrapped = FastLaunch(kernel)
    a, b, other = torch.zeros(16, 32), torch.zeros(16, 32), torch.zeros(16, 32)
    wrapped[(2,)](*_descs(a, b), 16, 2.0, B=16)
    prepared = wrapped.prepared(*_descs(a, b), 16, 2.0, B=16)
    before = encoder.calls
    for _ in range(3):
        prepared(1, 77, a, b, 16, 2.0)
    assert encoder.calls == before + 2
    prepared(1, 77, other, b, 16, 2.0)
    assert encoder.calls == before + 3
    first, *_, last = c_launch.calls[-4:]
    assert first[13] != last[13] and first[13 + 5:] == last[13 + 5:]


def test_no_descriptor_launch_without_tensor_maps(fake_tma, monkeypatch):
    kernel, compiles, _, _ = fake_tma
    wrapped = FastLaunch(kernel)
    a, b = torch.zeros(16, 32), torch.zeros(16, 32)
    wrapped[(2,)](*_descs(a, b), 16, 2.0, B=16)
    compiles[0].metadata.tensordesc_meta = None  # Triton kept base pointers, shapes and strides
    assert wrapped.prepared(*_descs(a, b), 16, 2.0, B=16) is None
    compiles[0].metadata.tensordesc_meta = [_META, dict(_META, fp4_padded=True)]
    assert wrapped.prepared(*_descs(a, b), 16, 2.0, B=16) is None


def test_descriptors_must_lead(monkeypatch):
    kernel, _, _, _ = _fake_tma(monkeypatch, _copy_late)
    wrapped = FastLaunch(kernel)
    a, b = torch.zeros(16, 32), torch.zeros(16, 32)
    wrapped[(2,)](16, *_descs(a, b), 2.0, B=16)
    with pytest.raises(ValueError, match="must lead"):
        wrapped.prepared(16, *_descs(a, b), 2.0, B=16)
