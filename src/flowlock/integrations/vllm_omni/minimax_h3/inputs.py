"""Validation of one ``MiniMaxH3DiTModel.forward`` call's keyword arguments, before any op runs.

vLLM-Omni's packed layout has no batch dimension: one sequence of ``S`` rows holds one or more
requests, each a run of rows ``[text | condition | audio | video]`` followed, when the sequence is
aligned, by padding rows (tag -1). ``packed_seq_params.cu_seqlens_q`` cuts it into attention
documents: one per request and one per nonempty padding run. The strict forward attends inside
each document only, so a padding row never reaches a real row.

Every check raises ``TypeError`` / ``ValueError`` naming the argument. The few host read-backs
(index ranges, document bounds) are memoized per tensor, so a layout reused across denoising
steps pays once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowlock.ops._validate import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_finite_range,
    check_index,
    check_tensor,
    memoized_over,
)

SUPPORTED_KWARGS = frozenset({
    "x", "audio_x", "img_position_ids", "unique_timesteps", "inverse_indices", "update_mask", "update_audio_mask",
    "token_tags", "skip_mask_out_condition", "prompt_embeds", "img_pos_info", "audio_pos_info", "text_pos_info",
    "img_pos_for_infer_output_info", "packed_seq_params", "refiner_packed_seq_params", "video_token_layout",
    "rope_table",
})
_REQUIRED = ("x", "audio_x", "img_position_ids", "unique_timesteps", "inverse_indices", "update_mask", "token_tags",
             "prompt_embeds", "img_pos_info", "audio_pos_info", "text_pos_info", "img_pos_for_infer_output_info",
             "packed_seq_params", "refiner_packed_seq_params")


@dataclass(frozen=True)
class NativeInputs:
    """One forward's validated inputs; row indices int64, bounds as host ints."""

    x: torch.Tensor  # (1, S, C_video) float
    audio_x: torch.Tensor  # (1, S, C_audio) float
    prompt_embeds: torch.Tensor  # (Nt, text_dim) float
    unique_timesteps: torch.Tensor  # (M,) float32 in [0, 1]
    inverse_indices: torch.Tensor  # (S,) in [0, M)
    token_tags: torch.Tensor  # (S,) in {-1, 0, 1, 2}
    img_position_ids: torch.Tensor  # (1, S, 3), the caller's tensor (memo key across steps)
    img_pos: torch.Tensor  # (Nv,) rows holding video latents
    audio_pos: torch.Tensor  # (Na,)
    text_pos: torch.Tensor  # (Nt,)
    out_pos: torch.Tensor  # (No,) video rows returned
    update_mask: torch.Tensor | None  # (No,), None when skip_mask_out_condition
    update_audio_mask: torch.Tensor | None  # (Na,)
    rope_table: torch.Tensor | None  # (S, R) bf16, vLLM-Omni's prepared table
    cu_seqlens: torch.Tensor
    max_seqlen: int
    num_requests: int
    refiner_cu_seqlens: torch.Tensor
    refiner_max_seqlen: int

    @property
    def seq_len(self) -> int:
        return int(self.token_tags.shape[0])


def documents(cu_seqlens: torch.Tensor, max_seqlen: int, total: int, *, prefix_request: bool,
              name: str = "packed_seq_params") -> tuple[tuple[int, int], ...]:
    """The nonempty ``(start, stop)`` row ranges of ``cu_seqlens`` over ``total`` rows.

    ``prefix_request``: the rows hold one request, whose real rows vLLM-Omni takes to be the prefix
    ``[0, min(max_seqlen, total))`` (the rest is padding), so ``cu_seqlens`` must be ``[0, used]``
    or ``[0, used, total]``. Otherwise every document must fit in ``max_seqlen``.
    """
    check_tensor(f"{name}.cu_seqlens_q", cu_seqlens, dtypes=INDEX_DTYPES, ndim=1)
    bounds = memoized_over([cu_seqlens], "cu_seqlens", lambda: tuple(int(b) for b in cu_seqlens.tolist()))
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != total or any(b > a for b, a in zip(bounds, bounds[1:])):
        raise ValueError(f"{name}.cu_seqlens_q must rise from 0 to {total} without decreasing, got {list(bounds)}")
    docs = tuple((a, b) for a, b in zip(bounds, bounds[1:]) if b > a)
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or not 0 < max_seqlen <= max(total, 1):
        raise ValueError(f"{name}.max_seqlen_q must be an int in [1, {total}], got {max_seqlen!r}")
    if prefix_request:
        used = min(max_seqlen, total)
        if docs[0] != (0, used) or len(docs) > 2:
            raise ValueError(f"{name}: one request must have cu_seqlens_q [0, {used}] or [0, {used}, {total}] "
                             f"(max_seqlen_q {max_seqlen}), got {list(bounds)}")
    elif max(b - a for a, b in docs) > max_seqlen:
        raise ValueError(f"{name}.max_seqlen_q {max_seqlen} is shorter than a document of {list(bounds)}")
    return docs


def _field(container: object, key: str, field: str, required: bool = True):
    value = container.get(field) if isinstance(container, dict) else getattr(container, field, None)
    if value is None and required:
        raise ValueError(f"{key}.{field} is required")
    return value


def _flat(t: torch.Tensor) -> torch.Tensor:
    # The caller's own object when already 1-D: memoized read-backs key on tensor identity, and a
    # layout's tensors are the same objects at every denoising step.
    return t if t.dim() == 1 else t.reshape(-1)


def _rows(kwargs: dict, key: str, seq_len: int, device: torch.device) -> torch.Tensor:
    ids = _field(kwargs[key], key, "position_ids")
    ids = _flat(check_tensor(f"{key}.position_ids", ids, dtypes=INDEX_DTYPES, device=device))
    return check_index(f"{key}.position_ids", ids.to(torch.int64), length=None, upper=seq_len, device=device)


def _unique(indices: list[torch.Tensor]) -> bool:
    every = torch.cat(indices)
    return every.numel() == 0 or torch.unique(every).numel() == every.numel()


def parse_inputs(kwargs: dict, video_width: int, audio_width: int) -> NativeInputs:
    """Check one forward's keyword arguments against the native contract and return them parsed.

    ``video_width`` / ``audio_width`` are the patch projections' input widths. Beyond the native
    model's own checks this requires: row indices unique (video, audio and text rows disjoint),
    the returned video rows among the video rows, one prompt row per text row, refiner documents
    covering exactly the prompt rows, tags in {-1, 0, 1, 2} and timesteps float32 in [0, 1].
    """
    unexpected = sorted(set(kwargs) - SUPPORTED_KWARGS)
    if unexpected:
        raise TypeError(f"MiniMaxH3DiTModel.forward received unexpected kwargs: {unexpected}")
    for key in _REQUIRED:
        if kwargs.get(key) is None:
            raise ValueError(f"MiniMaxH3DiTModel.forward requires kwarg {key!r}")
    x = check_tensor("x", kwargs["x"], dtypes=FLOAT_DTYPES, ndim=3)
    if x.shape[0] != 1 or x.shape[2] != video_width:
        raise ValueError(f"x must be [1, S, {video_width}], got {list(x.shape)}")
    seq_len, device = x.shape[1], x.device
    audio_x = check_tensor("audio_x", kwargs["audio_x"], dtypes=FLOAT_DTYPES, shape=(1, seq_len, audio_width),
                           device=device)
    positions = check_tensor("img_position_ids", kwargs["img_position_ids"], shape=(1, seq_len, 3), device=device)
    if not (positions.is_floating_point() or positions.dtype in INDEX_DTYPES):
        raise TypeError(f"img_position_ids must be an integer or float tensor, got {positions.dtype}")
    timesteps = check_tensor("unique_timesteps", kwargs["unique_timesteps"], dtypes=(torch.float32,), ndim=1,
                             device=device)
    if timesteps.shape[0] < 1:
        raise ValueError("unique_timesteps must hold at least one value")
    check_finite_range("unique_timesteps", timesteps, 0.0, 1.0)
    inverse = check_tensor("inverse_indices", kwargs["inverse_indices"], dtypes=INDEX_DTYPES, device=device)
    inverse = check_index("inverse_indices", _flat(inverse), length=seq_len, upper=timesteps.shape[0],
                          device=device)
    tags = _flat(check_tensor("token_tags", kwargs["token_tags"], dtypes=INDEX_DTYPES, device=device))
    if tags.shape[0] != seq_len:
        raise ValueError(f"token_tags must have {seq_len} entries, got {tags.shape[0]}")
    if not memoized_over([tags], "h3_tags", lambda: bool(((tags >= -1) & (tags <= 2)).all())):
        raise ValueError("token_tags values must lie in {-1, 0, 1, 2} (padding, video, text, audio)")

    img_pos, audio_pos, text_pos, out_pos = (_rows(kwargs, key, seq_len, device) for key in (
        "img_pos_info", "audio_pos_info", "text_pos_info", "img_pos_for_infer_output_info"))
    if not memoized_over([img_pos, audio_pos, text_pos], "disjoint_rows", lambda: _unique([img_pos, audio_pos,
                                                                                          text_pos])):
        raise ValueError("img_pos_info, audio_pos_info and text_pos_info rows must be unique and disjoint")
    if not memoized_over([out_pos, img_pos], "output_rows",
                         lambda: _unique([out_pos]) and bool(torch.isin(out_pos, img_pos).all())):
        raise ValueError("img_pos_for_infer_output_info rows must be unique video rows (img_pos_info)")

    prompt = check_tensor("prompt_embeds", kwargs["prompt_embeds"], dtypes=FLOAT_DTYPES, ndim=2, device=device)
    if prompt.shape[0] != text_pos.shape[0]:
        raise ValueError(f"prompt_embeds has {prompt.shape[0]} rows for {text_pos.shape[0]} text rows")

    skip = kwargs.get("skip_mask_out_condition", False)
    if not isinstance(skip, bool):
        raise TypeError(f"skip_mask_out_condition must be a bool, got {type(skip).__name__}")
    update_mask = None if skip else _flat(check_tensor("update_mask", kwargs["update_mask"], device=device))
    if update_mask is not None and update_mask.shape[0] != out_pos.shape[0]:
        raise ValueError(f"update_mask length mismatch: {update_mask.shape[0]} != {out_pos.shape[0]}")
    audio_mask = kwargs.get("update_audio_mask")
    if audio_mask is not None and not skip:
        audio_mask = _flat(check_tensor("update_audio_mask", audio_mask, device=device))
        if audio_mask.shape[0] != audio_pos.shape[0]:
            raise ValueError(f"update_audio_mask length mismatch: {audio_mask.shape[0]} != {audio_pos.shape[0]}")
    else:
        audio_mask = None

    rope_table = kwargs.get("rope_table")
    if rope_table is not None:
        check_tensor("rope_table", rope_table, dtypes=(torch.bfloat16,), ndim=2, device=device)
        if rope_table.shape[0] != seq_len:
            raise ValueError(f"rope_table must have {seq_len} rows, got {list(rope_table.shape)}")

    psp, rpsp = kwargs["packed_seq_params"], kwargs["refiner_packed_seq_params"]
    num_requests = _field(psp, "packed_seq_params", "num_requests", required=False) or 1
    if isinstance(num_requests, bool) or not isinstance(num_requests, int) or num_requests < 1:
        raise ValueError(f"packed_seq_params.num_requests must be a positive int, got {num_requests!r}")
    cu = _field(psp, "packed_seq_params", "cu_seqlens_q")
    max_seqlen = _field(psp, "packed_seq_params", "max_seqlen_q")
    documents(cu, max_seqlen, seq_len, prefix_request=num_requests == 1)
    refiner_cu = _field(rpsp, "refiner_packed_seq_params", "cu_seqlens_q")
    refiner_max = _field(rpsp, "refiner_packed_seq_params", "max_seqlen_q")
    documents(refiner_cu, refiner_max, prompt.shape[0], prefix_request=False, name="refiner_packed_seq_params")
    return NativeInputs(
        x=x, audio_x=audio_x, prompt_embeds=prompt, unique_timesteps=timesteps, inverse_indices=inverse.to(torch.int64),
        token_tags=tags.to(torch.int64), img_position_ids=positions, img_pos=img_pos, audio_pos=audio_pos,
        text_pos=text_pos, out_pos=out_pos, update_mask=update_mask, update_audio_mask=audio_mask,
        rope_table=rope_table, cu_seqlens=cu, max_seqlen=max_seqlen, num_requests=num_requests,
        refiner_cu_seqlens=refiner_cu, refiner_max_seqlen=refiner_max)
