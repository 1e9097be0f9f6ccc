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
"""

from __future__ import annotations

import socket
import threading
from types import SimpleNamespace

import torch

_SDPA_BACKEND = "vllm_omni.diffusion.attention.backends.sdpa.SDPABackend"
_lock = threading.Lock()
_ready = False


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
                                             distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
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
                 adaln_cache: bool = True, quant_config=None):
    """A real ``MiniMaxH3DiTModel`` (eval mode, CPU) for ``diffusers_config``.

    With ``state_dict`` (diffusers names) the weights are loaded by the model's own
    ``load_weights``; without, parameters hold whatever the constructor left (uninitialised).
    ``adaln_cache`` is ``od_config.cache_config.minimax_h3_adaln_cache`` (vLLM-Omni's default: on).
    """
    ensure_runtime()
    from vllm.config import set_current_vllm_config
    from vllm_omni.diffusion.models.minimax_h3.minimax_h3_transformer import MiniMaxH3DiTModel

    od_config = SimpleNamespace(tf_model_config=native_config(diffusers_config),
                                parallel_config=SimpleNamespace(ulysses_degree=1),
                                cache_config={"minimax_h3_adaln_cache": adaln_cache})
    with set_current_vllm_config(vllm_config()):
        model = MiniMaxH3DiTModel(od_config, quant_config)
    if state_dict is not None:
        model.load_weights(state_dict.items())
        model.post_load_weights()
    return model.eval()
