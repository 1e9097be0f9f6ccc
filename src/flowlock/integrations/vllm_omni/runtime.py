"""A vLLM-Omni ``MiniMaxH3DiTModel`` holding a diffusers H3's weights, in this process (TP = 1).

For the cross-engine demo and trace: vLLM needs a current ``VllmConfig`` and an initialised
model-parallel group before a parallel linear can be built; :func:`native_from_diffusers` sets a
one-rank group up once (gloo on a CPU, NCCL on CUDA) unless the caller already has one, builds the
native model from the diffusers config and loads the diffusers state dict through vLLM-Omni's own
``load_weights``.

No shim is installed here. vLLM-Omni picks a diffusion attention backend per platform while it
builds the model, and on a host without an accelerator it has none: that is reported as
:class:`NoAttentionBackend`, with what to do. (flowlock's strict path never calls that backend, but
the stock path does, and the model cannot be built without one.)
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from flowlock.parallel.ports import free_local_port


class NoAttentionBackend(RuntimeError):
    """vLLM-Omni selects no diffusion attention backend on this platform."""




def ensure_model_parallel(device: torch.device) -> None:
    """A one-rank model-parallel group (TP = 1) for this process, unless one exists already."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
        model_parallel_is_initialized,
    )

    if model_parallel_is_initialized():
        return
    with set_current_vllm_config(vllm_config(device)):
        init_distributed_environment(world_size=1, rank=0, local_rank=device.index or 0,
                                     distributed_init_method=f"tcp://127.0.0.1:{free_local_port()}",
                                     backend="nccl" if device.type == "cuda" else "gloo")
        initialize_model_parallel(1)


def native_model_dtype(native: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``native`` (a just-built ``MiniMaxH3DiTModel``) in ``dtype``, before its weights are loaded.

    ``torch.bfloat16``: as vLLM-Omni builds it (BF16, H3's FP32 modules FP32), returned unchanged.
    ``torch.float16``: the BF16 set cast to FP16, H3's FP32 modules kept FP32 (what
    ``make_h3(dtype=torch.float16)`` builds on the diffusers side). ``torch.float32``: every parameter
    and buffer cast to FP32. vLLM-Omni's constructor fixes BF16 for the BF16 set and has neither
    option; the strict path follows the parameters' dtypes (vLLM-Omni's own forward runs BF16 only).
    Any other dtype raises ValueError: casting the FP32 modules down is what vLLM-Omni's own
    ``post_load_weights`` refuses."""
    if dtype == torch.bfloat16:
        return native
    if dtype == torch.float16:
        for tensor in (*native.parameters(), *native.buffers()):
            if tensor.dtype == torch.bfloat16:
                tensor.data = tensor.data.to(torch.float16)
        return native
    if dtype == torch.float32:
        return native.float()
    raise ValueError(f"vLLM-Omni's H3 runs in bfloat16 or float16 (with its FP32 modules) or float32, got {dtype}")


def vllm_config(device: torch.device):
    """The ``VllmConfig`` a native model is built and run under on ``device`` (vLLM's defaults)."""
    from vllm.config import DeviceConfig, VllmConfig

    return VllmConfig(device_config=DeviceConfig(device.type))


def build_native(config: dict, state_dict: dict[str, torch.Tensor], device: torch.device, *,
                 dtype: torch.dtype = torch.bfloat16, adaln_cache: bool = True) -> nn.Module:
    """vLLM-Omni's ``MiniMaxH3DiTModel`` (eval, on ``device``, TP = 1) for the diffusers H3 ``config``,
    its weights loaded by the native model's own ``load_weights`` from the diffusers-named
    ``state_dict``, in ``dtype`` (see :func:`native_model_dtype`). ``adaln_cache`` is vLLM-Omni's AdaLN
    memo cache (its default: on; a benchmark repeating one timestep turns it off).

    Raises :class:`NoAttentionBackend` when vLLM-Omni has no attention backend for this platform.
    """
    from vllm.config import set_current_vllm_config
    from vllm_omni.diffusion.models.minimax_h3.minimax_h3_transformer import MiniMaxH3DiTModel

    ensure_model_parallel(device)
    hidden = config["hidden_size"]
    # the native defaults assume H = 5376 for the two AdaLN widths; the class name makes
    # load_weights take diffusers names
    native_config = {**dict(config), "adaln_out_features": 18 * hidden, "final_adaln_out_features": 2 * hidden,
                     "_class_name": "MiniMaxH3Transformer3DModel"}
    # the fields of vLLM-Omni's OmniDiffusionConfig the DiT reads
    od_config = SimpleNamespace(tf_model_config=native_config, parallel_config=SimpleNamespace(ulysses_degree=1),
                                cache_config={"minimax_h3_adaln_cache": adaln_cache})
    try:
        with set_current_vllm_config(vllm_config(device)), torch.device(device):
            native = native_model_dtype(MiniMaxH3DiTModel(od_config, None), dtype)
    except NotImplementedError as err:
        raise NoAttentionBackend(
            f"vLLM-Omni selects no diffusion attention backend on {device.type} ({err}); run the cross-engine "
            "demo on a GPU (CPU tests install an SDPA backend with a CPU forward: tests/vllm_omni_env.py)") from err
    native.load_weights(state_dict.items())
    native.post_load_weights()
    return native.eval()


def native_from_diffusers(model: nn.Module) -> nn.Module:
    """:func:`build_native` from the diffusers H3 ``model`` (its config, weights, device, and the dtype of
    its BF16-set ``context_embedder``: bf16 or float32), vLLM-Omni's AdaLN memo cache on."""
    return build_native(dict(model.config), model.state_dict(), next(model.parameters()).device,
                        dtype=model.context_embedder.weight.dtype)
