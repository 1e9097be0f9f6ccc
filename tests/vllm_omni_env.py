"""Run the real vLLM-Omni 0.30.0 ``MiniMaxH3DiTModel`` on a CPU-only test machine.

Test support only: the shims below make vLLM-Omni's CPU run possible and never ship in the library.

* vLLM needs a current ``VllmConfig`` on the CPU device and an initialised model-parallel group
  (TP = 1) before a parallel linear can be built: :func:`ensure_runtime` sets both up once per
  process, with a gloo group on a free local port (pytest-xdist workers are separate processes).
* vLLM-Omni's platform on a CPU ("unspecified") picks no diffusion attention backend and its
  ``AttentionImpl.forward`` has no CPU branch: the platform is told to use the SDPA backend and
  the SDPA impl gets a CPU forward. That forward slices K/V to ``valid_kv_length`` and drops the
  key mask, as the varlen / cuDNN backends do on a GPU: on a CPU, SDPA with a key-padding mask
  rounds real rows differently from SDPA over the real keys for most lengths, which would make a
  padded stock run differ from an unpadded one for reasons no GPU backend has.

:func:`build_native` builds the native model from a diffusers H3 config (the tiny configs need the
two AdaLN widths the native defaults assume for H = 5376) and loads a diffusers state dict through
vLLM-Omni's own ``load_weights``.

:func:`pin_pure_python_platforms` is for a GPU host whose vllm is only its Python files (the H200
bundle, ``tools/vllm_omni_bundle.py``): there vLLM's and vLLM-Omni's platform detection would find
the GPU through NVML and pick their CUDA platforms, whose module imports vllm's compiled ops. It
makes both detections see no GPU, so both resolve to the platforms a CPU host gets; the shims above
then apply unchanged (attention through torch SDPA on the caller's device). Where PyAV is not
installed it also puts a placeholder ``av`` module in place: vLLM treats PyAV as optional (its own
placeholder), but ``vllm_omni.diffusion.utils.media_utils`` (reached from the H3 package's pipeline
module) imports it at module level, to mux output videos only; any use of the placeholder raises.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import threading
import types
from pathlib import Path
from types import SimpleNamespace

import torch

from flowlock.parallel.ports import free_local_port

_SDPA_BACKEND = "vllm_omni.diffusion.attention.backends.sdpa.SDPABackend"
_lock = threading.Lock()
_ready = False


def vllm_has_compiled_ops() -> bool:
    """Whether the vllm found on the path has ``_C_stable_libtorch`` (which ``vllm.platforms.cuda``
    imports unconditionally); found without importing vllm."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return False
    return any(any(Path(p).glob("_C_stable_libtorch*.so")) for p in spec.submodule_search_locations)


def pin_pure_python_platforms() -> bool:
    """Before vllm is imported, on a vllm without compiled ops: NVML (vllm's vendored pynvml, which
    both platform detections call) reports no device, so vLLM resolves ``UnspecifiedPlatform`` and
    vLLM-Omni ``UnspecifiedOmniPlatform``, as on a CPU host; and a placeholder ``av`` if PyAV is
    missing. Returns whether it pinned; raises RuntimeError when vllm is already imported (its
    platform is resolved at import)."""
    if vllm_has_compiled_ops():
        return False
    if "vllm" in sys.modules:
        if "vllm.third_party.pynvml" in sys.modules and getattr(sys.modules["vllm.third_party.pynvml"],
                                                                 "_flowlock_no_device", False):
            return True
        raise RuntimeError("pin_pure_python_platforms() must run before vllm is imported")
    nvml = types.ModuleType("vllm.third_party.pynvml")
    nvml._flowlock_no_device = True
    nvml.nvmlInit = nvml.nvmlShutdown = lambda *a, **k: None
    nvml.nvmlDeviceGetCount = lambda: 0
    sys.modules["vllm.third_party.pynvml"] = nvml
    if importlib.util.find_spec("av") is None:
        sys.modules["av"] = _placeholder("av", "vLLM-Omni imports PyAV only to mux output videos")
    return True


def _placeholder(name: str, why: str) -> types.ModuleType:
    module = types.ModuleType(name)
    # a spec, so importlib.util.find_spec (diffusers' availability probe) answers instead of raising
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)

    def missing(attribute: str):
        raise AttributeError(f"{name} is not installed ({why}): {name}.{attribute} is unavailable")

    module.__getattr__ = missing
    return module


def check_pure_python_platforms() -> None:
    """Raise RuntimeError unless vLLM and vLLM-Omni run on their unspecified platforms."""
    from vllm.platforms import current_platform
    from vllm_omni.platforms import current_omni_platform

    names = type(current_platform).__name__, type(current_omni_platform).__name__
    if names != ("UnspecifiedPlatform", "UnspecifiedOmniPlatform"):
        raise RuntimeError(f"vLLM / vLLM-Omni platforms are {names}, not the unspecified ones")




def _sdpa_cpu_forward(self, query, key, value, attn_metadata=None):
    used = None if attn_metadata is None else attn_metadata.extra.get("valid_kv_length")
    if used is not None and attn_metadata.attn_mask is not None and used < key.shape[1]:
        key, value = key[:, :used], value[:, :used]
        attn_metadata = type(attn_metadata)(**{**vars(attn_metadata), "attn_mask": None})
    return self.forward_cuda(query, key, value, attn_metadata)


def _install_shims() -> None:
    from vllm_omni.diffusion.attention.backends.sdpa import SDPAImpl
    from vllm_omni.platforms.interface import UnspecifiedOmniPlatform

    UnspecifiedOmniPlatform.get_diffusion_attn_backend_cls = classmethod(lambda cls, *a, **k: _SDPA_BACKEND)
    SDPAImpl.forward = _sdpa_cpu_forward


def vllm_config():
    """The CPU ``VllmConfig`` every native model here is built under."""
    from vllm.config import DeviceConfig, VllmConfig

    return VllmConfig(device_config=DeviceConfig("cpu"))


def ensure_runtime() -> None:
    """Install the CPU shims and a one-rank gloo model-parallel group, once per process."""
    global _ready
    with _lock:
        if _ready:
            return
        from vllm.config import set_current_vllm_config
        from vllm.distributed.parallel_state import (
            init_distributed_environment,
            initialize_model_parallel,
            model_parallel_is_initialized,
        )

        _install_shims()
        with set_current_vllm_config(vllm_config()):
            if not model_parallel_is_initialized():
                init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                             distributed_init_method=f"tcp://127.0.0.1:{free_local_port()}")
                initialize_model_parallel(1)
        _ready = True


def native_config(diffusers_config: dict) -> dict:
    """``tf_model_config`` for the native model from a diffusers H3 config (diffusers names).

    Adds the AdaLN output widths (the native defaults are those of H = 5376) and the diffusers
    class name, which makes ``load_weights`` take diffusers state-dict names.
    """
    hidden = diffusers_config["hidden_size"]
    return {**diffusers_config, "adaln_out_features": 18 * hidden, "final_adaln_out_features": 2 * hidden,
            "_class_name": "MiniMaxH3Transformer3DModel"}


def build_native(diffusers_config: dict, state_dict: dict[str, torch.Tensor] | None = None, *,
                 adaln_cache: bool = True, quant_config=None, dtype: torch.dtype = torch.bfloat16):
    """A real ``MiniMaxH3DiTModel`` (eval mode, CPU) for ``diffusers_config``.

    With ``state_dict`` (diffusers names) the weights are loaded by the model's own
    ``load_weights``; without, parameters hold whatever the constructor left (uninitialised).
    ``adaln_cache`` is ``od_config.cache_config.minimax_h3_adaln_cache`` (vLLM-Omni's default: on).
    ``dtype``: ``torch.bfloat16`` is vLLM-Omni's own layout (BF16, H3's FP32 modules FP32, as its
    constructor fixes them); ``torch.float32`` casts the constructed model whole to FP32 before the
    weights are loaded (vLLM-Omni has no FP32 option: :func:`flowlock.integrations.vllm_omni.runtime.
    native_model_dtype` does the same).
    """
    ensure_runtime()
    from vllm.config import set_current_vllm_config
    from vllm_omni.diffusion.models.minimax_h3.minimax_h3_transformer import MiniMaxH3DiTModel

    od_config = SimpleNamespace(tf_model_config=native_config(diffusers_config),
                                parallel_config=SimpleNamespace(ulysses_degree=1),
                                cache_config={"minimax_h3_adaln_cache": adaln_cache})
    from flowlock.integrations.vllm_omni.runtime import native_model_dtype

    with set_current_vllm_config(vllm_config()):
        model = native_model_dtype(MiniMaxH3DiTModel(od_config, quant_config), dtype)
    if state_dict is not None:
        model.load_weights(state_dict.items())
        model.post_load_weights()
    return model.eval()
