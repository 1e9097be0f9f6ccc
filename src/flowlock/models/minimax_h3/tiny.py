"""A real diffusers ``MiniMaxH3Transformer3DModel`` with tiny dimensions and seeded random weights.

It keeps H3's structure (3 modalities, AdaLN table, 3-axis partial RoPE on 96 of 128 head
channels, SwiGLU, refiner, FP32 input/output modules, BF16 elsewhere) at sizes that run on a CPU
in well under a second.
"""

from __future__ import annotations

import torch

from flowlock.models.minimax_h3.packing import H3Packing, build_packing

TINY_H3_CONFIG = dict(
    num_attention_heads=2,
    attention_head_dim=128,
    hidden_size=64,
    num_layers=2,
    num_refiner_layers=1,
    ffn_dim=96,
    in_channels=4,
    audio_in_channels=8,
    patch_size=(1, 2, 2),
    text_dim=48,
    freq_dim=256,
    time_embed_hidden_dim=80,
    time_embed_dim=40,
    rope_freq_dim=16,
)

def full_width_config(num_layers: int, num_refiner_layers: int) -> dict:
    """H3's full widths (the diffusers defaults) with ``num_layers`` blocks and ``num_refiner_layers``
    refiner blocks: the stand-in for the 33B model in GPU evidence (per-block time scales linearly)."""
    return dict(num_attention_heads=56, attention_head_dim=128, hidden_size=5376, num_layers=num_layers,
                num_refiner_layers=num_refiner_layers, ffn_dim=14336, in_channels=24, audio_in_channels=32,
                patch_size=(1, 2, 2), text_dim=5120, freq_dim=256, time_embed_hidden_dim=5376,
                time_embed_dim=2688, rope_freq_dim=16)


FP32_MODULES = ("proj_in", "audio_proj_in", "time_embedder", "proj_out", "audio_proj_out", "rope")


def make_h3(config: dict, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
            device: torch.device | str = "cpu", draw_on_device: bool = False):
    """Build the diffusers H3 model with seeded random weights; FP32 modules stay FP32, the rest ``dtype``.

    Weights are drawn on the CPU so the same seed gives the same model on every device, unless
    ``draw_on_device`` (full-width models: drawing billions of values on a GPU takes seconds, not
    minutes; the weights then depend on the device's generator).
    """
    from diffusers import MiniMaxH3Transformer3DModel

    draw = torch.device(device) if draw_on_device else torch.device("cpu")
    devices = [draw.index or 0] if draw.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), draw:
        torch.manual_seed(seed)
        model = MiniMaxH3Transformer3DModel(**config)
        # Default inits leave the AdaLN tables near zero; widen them so modulation matters in tests.
        for name, p in model.named_parameters():
            if "adaln_proj" in name or "norm_out.linear" in name:
                p.data.normal_(0.0, 0.2 if name.endswith("bias") else 0.05)
            elif name.endswith("norm.weight") or ".norm" in name:
                p.data.uniform_(0.5, 1.5)
    for name, module in model.named_modules():
        keep = any(name == k or name.startswith(k + ".") for k in FP32_MODULES)
        for p in module.parameters(recurse=False):
            p.data = p.data.to(torch.float32 if keep else dtype)
        for bname, b in module.named_buffers(recurse=False):
            if b.is_floating_point():
                setattr(module, bname, b.to(torch.float32 if keep else dtype))
    return model.to(device).eval()


def tiny_h3(seed: int = 0, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu"):
    """The tiny H3 of :data:`TINY_H3_CONFIG`."""
    return make_h3(TINY_H3_CONFIG, seed, dtype, device)


def tiny_packing() -> H3Packing:
    """5 text rows, a 2x2x3 video grid, 7 audio rows: S = 24, deliberately not a tile multiple."""
    return build_packing(num_text=5, latent_t=2, latent_h=2, latent_w=3, audio_rows=7)


def tiny_inputs(batch: int, seed: int = 0, config: dict = TINY_H3_CONFIG, packing: H3Packing | None = None,
                timestep: tuple[float, float] = (0.3, 0.55), device: torch.device | str = "cpu") -> dict:
    """Keyword arguments for one forward of ``batch`` samples sharing one packing (FP32 latents)."""
    packing = packing or tiny_packing()
    gen = torch.Generator().manual_seed(seed)
    c = config
    video_dim = c["in_channels"] * c["patch_size"][0] * c["patch_size"][1] * c["patch_size"][2]
    nv, na, nt = (packing.video_indices.numel(), packing.audio_indices.numel(), packing.text_indices.numel())
    kwargs = dict(
        hidden_states=torch.randn(batch, nv, video_dim, generator=gen),
        audio_hidden_states=torch.randn(batch, na, c["audio_in_channels"], generator=gen),
        encoder_hidden_states=torch.randn(batch, nt, c["text_dim"], generator=gen).to(torch.bfloat16),
        timestep=torch.tensor(timestep, dtype=torch.float32),
        **packing.model_kwargs(),
    )
    return {k: v.to(device) for k, v in kwargs.items()}
