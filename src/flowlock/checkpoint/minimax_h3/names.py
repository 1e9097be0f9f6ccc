"""The complete diffusers <-> vLLM-Omni native name table of one H3 geometry.

Each :class:`Entry` ties one native tensor to the diffusers tensors it is made of, with the shapes
both sides must have and the transform between them. The table is generated from the geometry
rather than parsed from names, so "expected" is exact: every name outside it is unknown, every
name of it that is absent is missing. At H3's sizes it has 535 entries covering the 638 diffusers
tensors (50 x 12 block, 2 x 10 refiner-block and 18 model-level tensors) and the 535 native ones
(534 parameters and the persistent ``rope.inv_freq`` buffer, which diffusers recomputes from
``rope_theta`` instead of storing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from flowlock.checkpoint.minimax_h3.geometry import H3Geometry

Kind = Literal["rename", "fc1", "qkv", "rope"]

# Stored FP32 by both engines (vLLM-Omni asserts it after loading); the rest is the model dtype.
_FP32_MODULES = ("proj_in", "audio_proj_in", "time_embedder.linear_1", "time_embedder.linear_2", "proj_out",
                 "audio_proj_out")


@dataclass(frozen=True)
class Entry:
    """One native tensor and its diffusers sources.

    ``kind``: ``rename`` (same bits, new name), ``fc1`` (rows' two halves swapped: diffusers
    ``ff.net.0.proj`` is [value; gate], native ``mlp.fc1`` is [gate; value]), ``qkv`` (diffusers
    to_q, to_k, to_v each [heads*head_dim, hidden]; native ``attn.qkv_proj`` [3*heads*head_dim,
    hidden] in the layout the caller names) or ``rope`` (native only, computed from the config).
    """

    kind: Kind
    native: str
    native_shape: tuple[int, ...]
    diffusers: tuple[str, ...]
    diffusers_shapes: tuple[tuple[int, ...], ...]
    fp32: bool


def _linear(entries: list[Entry], diffusers: str, native: str, out: int, inp: int, bias: bool,
            kind: Kind = "rename") -> None:
    fp32 = diffusers in _FP32_MODULES
    entries.append(Entry(kind, f"{native}.weight", (out, inp), (f"{diffusers}.weight",), ((out, inp),), fp32))
    if bias:
        entries.append(Entry("rename", f"{native}.bias", (out,), (f"{diffusers}.bias",), ((out,),), fp32))


def _norm(entries: list[Entry], diffusers: str, native: str, width: int) -> None:
    entries.append(Entry("rename", f"{native}.weight", (width,), (f"{diffusers}.weight",), ((width,),), False))


def _block(entries: list[Entry], g: H3Geometry, diffusers: str, native: str, adaln: bool) -> None:
    h, inner = g.hidden_size, g.inner_dim
    _norm(entries, f"{diffusers}norm1", f"{native}norm1", h)
    _norm(entries, f"{diffusers}norm2", f"{native}norm2", h)
    qkv = tuple(f"{diffusers}attn.to_{p}.weight" for p in "qkv")
    entries.append(Entry("qkv", f"{native}attn.qkv_proj.weight", (3 * inner, h), qkv, ((inner, h),) * 3, False))
    _norm(entries, f"{diffusers}attn.norm_q", f"{native}attn.q_norm", g.attention_head_dim)
    _norm(entries, f"{diffusers}attn.norm_k", f"{native}attn.k_norm", g.attention_head_dim)
    _linear(entries, f"{diffusers}attn.to_out.0", f"{native}attn.out_proj", h, inner, False)
    _linear(entries, f"{diffusers}ff.net.0.proj", f"{native}mlp.fc1", 2 * g.ffn_dim, h, False, "fc1")
    _linear(entries, f"{diffusers}ff.net.2", f"{native}mlp.fc2", h, g.ffn_dim, False)
    if adaln:
        _linear(entries, f"{diffusers}adaln_proj.linear", f"{native}adaln_proj.linear", 18 * h, g.time_embed_dim,
                True)


def name_table(g: H3Geometry) -> tuple[Entry, ...]:
    """All entries of geometry ``g``, in vLLM-Omni's module order."""
    h = g.hidden_size
    entries: list[Entry] = []
    for diffusers, native, out, inp in (("proj_in", "video_patch_proj", h, g.video_patch_dim),
                                         ("audio_proj_in", "audio_patch_proj", h, g.audio_in_channels),
                                         ("context_embedder", "condition_proj", h, g.text_dim),
                                         ("time_embedder.linear_1", "time_embedder.proj_in", g.time_embed_hidden_dim,
                                          g.freq_dim),
                                         ("time_embedder.linear_2", "time_embedder.proj_out", g.time_embed_dim,
                                          g.time_embed_hidden_dim)):
        _linear(entries, diffusers, native, out, inp, True)
    entries.append(Entry("rope", "rope.inv_freq", (g.rope_freq_dim,), (), (), True))
    for i in range(g.num_refiner_layers):
        _block(entries, g, f"token_refiner.refiner_blocks.{i}.", f"token_refiner.blocks.{i}.", adaln=False)
    _norm(entries, "token_refiner.final_norm", "token_refiner.final_norm", h)
    for i in range(g.num_layers):
        _block(entries, g, f"transformer_blocks.{i}.", f"blocks.{i}.", adaln=True)
    _norm(entries, "norm_out.norm", "final_layer.norm", h)
    _linear(entries, "norm_out.linear", "final_layer.adaln_proj.linear", 2 * h, g.time_embed_dim, True)
    _linear(entries, "proj_out", "final_layer.video_out", g.video_patch_dim, h, True)
    _linear(entries, "audio_proj_out", "final_layer.audio_out", g.audio_in_channels, h, True)
    return tuple(entries)
