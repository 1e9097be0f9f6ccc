"""Frozen Triton launch configurations: the only place tile sizes, warps and stages live.

Configs are keyed by ``(op, dtype, arch)`` and, for GEMMs, by the weight shape ``(N, K)``; never by
the token count, and nothing is autotuned at run time, so an output element's accumulation order
is the same in every batch, process and run on a given architecture. ``arch`` is ``"sm90"`` style
or ``"any"``; ``"interp"`` (the CPU interpreter) resolves to the ``"any"`` entries.

Each entry carries a note saying how and where it was chosen.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from flowlock.keys import arch_of_device, dtype_key


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes (``blocks``, name -> int), ``num_warps`` and ``num_stages`` of one kernel."""

    blocks: tuple[tuple[str, int], ...]
    num_warps: int
    num_stages: int = 1
    note: str = ""

    def __getitem__(self, name: str) -> int:
        for key, value in self.blocks:
            if key == name:
                return value
        raise KeyError(name)

    def with_blocks(self, **blocks: int) -> LaunchConfig:
        """This config with ``blocks`` set (added or replaced), warps, stages and note kept: a sweep
        candidate or a test's variant of a frozen config."""
        return replace(self, blocks=tuple(sorted((dict(self.blocks) | blocks).items())))


def _cfg(num_warps: int, num_stages: int = 1, note: str = "", **blocks: int) -> LaunchConfig:
    return LaunchConfig(tuple(sorted(blocks.items())), num_warps, num_stages, note)


_CONFIGS: dict[tuple[str, str, str, tuple[int, ...]], LaunchConfig] = {}


def register(op: str, dtype: str, arch: str, config: LaunchConfig, shape: tuple[int, ...] = ()) -> None:
    """Add one frozen entry (called at import of this module only)."""
    key = (op, dtype, arch, shape)
    if key in _CONFIGS:
        raise ValueError(f"duplicate launch config {key}")
    _CONFIGS[key] = config


def launch_config(op: str, dtype: torch.dtype, arch: str, shape: tuple[int, ...] = ()) -> LaunchConfig:
    """Look up the frozen config; exact ``(arch, shape)`` first, then ``"any"`` arch, then no shape."""
    d = dtype_key(dtype)
    arch = "any" if arch == "interp" else arch
    for key in ((op, d, arch, shape), (op, d, "any", shape), (op, d, arch, ()), (op, d, "any", ())):
        if key in _CONFIGS:
            return _CONFIGS[key]
    raise KeyError(f"no launch config for op={op} dtype={d} arch={arch} shape={shape}")

def config_for(op: str, t: torch.Tensor, shape: tuple[int, ...] = (), dtype: torch.dtype | None = None
               ) -> LaunchConfig:
    """``launch_config(op, dtype or t.dtype, arch_of(t), shape)`` for the device holding ``t`` (memoized,
    see :func:`config_on`)."""
    return config_on(op, dtype or t.dtype, t.device, shape)


@functools.cache
def config_on(op: str, dtype: torch.dtype, device: torch.device, shape: tuple[int, ...] = ()) -> LaunchConfig:
    """``launch_config`` for a device, memoized: the table never changes after import, and walking its
    keys plus inspecting the device costs a few us of host time per launch, which small-S calls feel."""
    return launch_config(op, dtype, arch_of_device(device), shape)


# norms (segment_sum, rms_norm, rms_norm_modulate, gate_residual): sizes by design, not yet timed on an H200.
# segment_sum's TILE_ROWS = 64 is the partial-buffer layout contract: the same on every arch and dtype.
for _dt in ("fp32", "bf16", "fp16"):
    # ONE_SEGMENT: a tile whose rows share one segment reduces that segment alone (same bits, one tree for R)
    register("segment_sum_partials", _dt, "any", _cfg(4, TILE_ROWS=64, BLOCK_N=32, ONE_SEGMENT=1,
                                                      note="interpreter-sized"))
    register("segment_sum_partials", _dt, "sm90", _cfg(4, TILE_ROWS=64, BLOCK_N=128, ONE_SEGMENT=1,
                                                       note="64x128 tile per program"))
    register("rms_norm_fwd", _dt, "any", _cfg(4, ROWS=16, note="interpreter-sized: few programs"))
    register("rms_norm_fwd", _dt, "sm90", _cfg(16, ROWS=1, note="one row per program; 16 warps hold 8192 cols"))
    # rms_norm_bwd: num_warps and DX_ROWS are the dx launch's, DW_WARPS, BLOCK_C and SUB_ROWS the dweight one's.
    register("rms_norm_bwd", _dt, "any", _cfg(4, TILE_ROWS=64, SUB_ROWS=64, DX_ROWS=16, BLOCK_C=32, DW_WARPS=4,
                                              note="interpreter-sized; dweight over the whole tile at once"))
    register("rms_norm_bwd", _dt, "sm90", _cfg(16, TILE_ROWS=64, SUB_ROWS=1, DX_ROWS=1, BLOCK_C=512, DW_WARPS=4,
                                               note="dx: one row per program, 16 warps, as the forward; dweight: "
                                                    "rows one by one per 512-column block"))
    register("gate_residual", _dt, "any", _cfg(4, ROWS=16, BLOCK_H=64, note="interpreter-sized"))
    register("gate_residual", _dt, "sm90", _cfg(4, ROWS=1, BLOCK_H=1024, note="elementwise, memory-bound"))
# fold_partials: GROUP (tiles per program per level) is part of the reduction order; "any" keeps it small so
# CPU tests cross several groups and levels.
register("fold_partials", "fp32", "any", _cfg(4, GROUP=4, BLOCK=256, note="interpreter-sized"))
register("fold_partials", "fp32", "sm90", _cfg(4, GROUP=32, BLOCK=512, note="by design, not yet timed on an H200"))

# timestep, euler, swiglu, qk_norm_rope: sizes by design (memory-bound elementwise / GEMV), not yet timed on an H200.
for _dt in ("fp32", "bf16", "fp16"):
    register("euler_step", _dt, "any", _cfg(4, BLOCK=256, note="interpreter-sized"))
    register("euler_step", _dt, "sm90", _cfg(4, BLOCK=1024, note="elementwise, memory-bound"))
register("timestep_sinusoid", "fp32", "any", _cfg(4, note="one timestep row of 256 channels per program"))
register("timestep_mlp", "fp32", "any", _cfg(4, BLOCK_N=16, BLOCK_K=64, VEC=4, PDL=0,
                                             note="interpreter-sized; K = 256 crosses four slices"))
register("timestep_mlp", "fp32", "sm90", _cfg(4, BLOCK_N=2, BLOCK_K=256, VEC=4, PDL=1,
                                              note="H200 sweep (diag probe, 45 tile/warp variants, T = 1 and 3): "
                                                   "linear_2 (2688x5376) 27.5 -> 18.8 us at T = 1 and 50.8 -> "
                                                   "35.7 us at T = 3 against the per-slice-tree design; one row "
                                                   "per program beat four-row groups at T = 1; launched as "
                                                   "linear_1's programmatic dependent (PDL): both layers 25.5 -> "
                                                   "24.1 us at T = 1, 45.2 -> 44.4 us at T = 3"))
register("timestep_mlp", "fp32", "sm90", _cfg(2, BLOCK_N=4, BLOCK_K=256, VEC=4, PDL=1,
                                              note="linear_1 (5376x256): K is one slice; H200 sweep best at T = 1 "
                                                   "(5.5 us) and within 0.5 us of the best at T = 3"),
         (5376, 256))
register("timestep_mlp_t", "fp32", "any", _cfg(4, BLOCK_N=32, BLOCK_K=16, note="interpreter-sized"))
register("timestep_mlp_t", "fp32", "sm90", _cfg(4, BLOCK_N=16, BLOCK_K=32,
                                                note="d act = g @ w2 (w2 2688x5376 read along its rows, 64 B per "
                                                     "k): H200 sweep (diag probe, 40 variants) best over T = 1 "
                                                     "and 3 (23.4 / 33.7 us alone)"))
register("timestep_mlp_t", "fp32", "sm90", _cfg(4, BLOCK_N=8, BLOCK_K=256,
                                                note="d x = d h @ w1 has 256 columns: narrow tiles give 32 "
                                                     "programs per row; H200 sweep 9.7 / 10.1 us alone at T = 1 / 3 "
                                                     "(the per-slice-tree design took about 18 / 42 us)"),
         (5376, 256))
register("timestep_mlp_wgrad", "fp32", "any", _cfg(4, BLOCK_N=16, BLOCK_K=32, note="interpreter-sized"))
register("timestep_mlp_wgrad", "fp32", "sm90",
         _cfg(4, BLOCK_N=32, BLOCK_K=128, note="dW written once, T rows ascending"))
for _dt in ("bf16", "fp16", "fp32"):
    register("swiglu", _dt, "any", _cfg(4, BLOCK=64, note="interpreter-sized"))
    register("swiglu", _dt, "sm90", _cfg(4, BLOCK=1024, note="elementwise, memory-bound; fp16/fp32 reuse bf16's"))
for _dt in ("bf16", "fp16", "fp32"):
    register("qk_norm_rope_fwd", _dt, "any", _cfg(4, BLOCK_ROWS=4, note="interpreter-sized; ragged last block"))
    register("qk_norm_rope_fwd", _dt, "sm90", _cfg(4, BLOCK_ROWS=16, note="16 (token, head) rows per program"))
    register("qk_norm_rope_bwd", _dt, "any", _cfg(4, TILE_ROWS=32, SUB_ROWS=8, note="dweight partials over 32-row "
                                                                                   "tiles, 8 rows at a time"))
    register("qk_norm_rope_bwd", _dt, "sm90", _cfg(4, TILE_ROWS=64, SUB_ROWS=16,
                                                   note="64-row tiles (S = 925 fills the GPU), 16 rows at a time; "
                                                        "fp16/fp32 reuse the bf16 size"))

# rows (gather_rows / scatter_rows): pure copies; BLOCK_H by design (bandwidth-bound), not yet timed on an H200.
for _dt in ("fp32", "bf16", "fp16"):
    register("rows", _dt, "any", _cfg(4, BLOCK_H=1024, note="one 1024-channel slice of one row per program"))
# attention: keyed by the power-of-two head tile BLOCK_D (a padded head dim runs its tile's entry); "any" tiles are
# interpreter-sized so odd test shapes cross several blocks
_ATTN_SM90 = ("best of two sweeps at B=1, 56 heads, D=128, S=16384 on an H200 (bench_attention.py --sweep, "
              "benchmarks/results/attention_h200_run*.json); D=32/64 reuse the D=128 tiles untimed; "
              "TMA=1 reads q/k/v/dO through descriptors (same bits as TMA=0, the pointer loads)")
_DP_FIRST = ("; DP_FIRST=1: backward 3% faster at S = 4096, 16384 and 32768 in the H200 sweep of 49d5e61 "
             "(same bits; no gain for dQ, which keeps the plain order)")
# D = 128 (H3's heads, and the padded 65..127): the backward is the one-pass Gluon kernel wherever it applies, and
# the separate kernels elsewhere compute its dQ sum (per-128-row KV-block terms in ascending order)
_ONE_PASS = ("; ONE_PASS=2: the one-pass Gluon backward (TMA-eligible bf16 / fp16 D = 128), tickets in groups "
             "of 2 heads, the one grouping under the separate kernels' time at every S measured on an H100 "
             "(0.84-1.00 at S = 925..32768, attention_one_pass_h100_8f93e79.json; G = 4 / 8 were faster below "
             "S = 16384 but 1.1-1.4x at long S; since the loader stages the row statistics (cc573f8) G = 4 ties "
             "G = 2 at S = 16384 / 32768 and is 2-4% faster below, one H100 run: "
             "attention_one_pass_staged_h100_cc573f8.log)")
_GLUON_FWD = ("; GLUON=1: the Gluon forward (TMA-eligible bf16 / fp16 D = 128; same bits as these tiles), "
              "0.84-0.92 of this config's Triton forward at S = 925..32768 and 0.97 / 1.00 of cuDNN's time at "
              "S = 4253 / 16384 in two H100 runs (attention_gluon_fwd_h100_fee6cf2*.json)")
_DQ_FOLD = ("; DQ_FOLD=1 on 128-row KV blocks: the one-pass kernel's dQ sum for the operands it does not serve "
            "(the whole backward 1.08-1.19x the chained separate kernels' time on H100s; two stages, as four "
            "128 x 128 K / V tiles beside the Q / dO rows exceed shared memory)")
_ATTN_NEW = "by design, untimed: {} (fits shared memory and registers on paper; compile and sweep on an H200)"
for _dt in ("bf16", "fp16", "fp32"):
    for _d in (16, 32, 64, 128, 256):
        for _op in ("attention_fwd", "attention_bwd_dkdv", "attention_bwd_dq"):
            register(_op, _dt, "any", _cfg(4, BLOCK_M=16, BLOCK_N=16, TMA=0, note="interpreter-sized"), (_d,))
        register("attention_bwd_delta", _dt, "any", _cfg(4, BLOCK_M=16, note="interpreter-sized"), (_d,))
        register("attention_bwd_delta", _dt, "sm90", _cfg(4, BLOCK_M=64, note="memory-bound row sums"), (_d,))
# bf16 D = 32/64/128: the swept entries; fp16 (same bytes, same tensor-core rate) takes the same tiles
for _dt in ("bf16", "fp16"):
    for _d in (16, 32, 64, 128):
        if _dt == "fp16":
            _note = _ATTN_NEW.format("fp16 takes the bf16 tiles")
        else:
            _note = _ATTN_SM90 if _d > 16 else _ATTN_NEW.format("D=16 takes the D=128 tiles")
        if _d == 128:
            _fwd = _cfg(8, 3, BLOCK_M=128, BLOCK_N=128, TMA=1, GLUON=1, note=_note + _GLUON_FWD)
            _dkdv = _cfg(8, 3, BLOCK_M=64, BLOCK_N=128, TMA=1, DP_FIRST=1, ONE_PASS=2,
                         note=_note + _DP_FIRST + _ONE_PASS)
            _dq = _cfg(8, 2, BLOCK_M=128, BLOCK_N=128, TMA=1, DQ_FOLD=1, note=_note + _DQ_FOLD)
        else:
            _fwd = _cfg(8, 3, BLOCK_M=128, BLOCK_N=128, TMA=1, note=_note)
            _dkdv = _cfg(8, 3, BLOCK_M=64, BLOCK_N=128, TMA=1, DP_FIRST=1, note=_note + _DP_FIRST)
            _dq = _cfg(8, 4, BLOCK_M=128, BLOCK_N=64, TMA=1, note=_note)
        register("attention_fwd", _dt, "sm90", _fwd, (_d,))
        register("attention_bwd_dkdv", _dt, "sm90", _dkdv, (_d,))
        register("attention_bwd_dq", _dt, "sm90", _dq, (_d,))
    # D = 256 (and padded 136..248): half-size KV tiles keep the fp32 accumulators and staged K/V on chip
    _note = _ATTN_NEW.format("D=256 halves the KV tiles of D=128")
    register("attention_fwd", _dt, "sm90", _cfg(8, 2, BLOCK_M=64, BLOCK_N=64, TMA=1, note=_note), (256,))
    register("attention_bwd_dkdv", _dt, "sm90", _cfg(8, 2, BLOCK_M=32, BLOCK_N=64, TMA=1, DP_FIRST=1, note=_note),
             (256,))
    register("attention_bwd_dq", _dt, "sm90", _cfg(8, 2, BLOCK_M=64, BLOCK_N=32, TMA=1, note=_note), (256,))
# fp32: true-fp32 FMA products (no tensor cores) hold whole operand rows in registers, so the tiles are small
# and some spilling remains; chosen by offline sm90 compiles (Triton 3.6 + bundled ptxas, no GPU): at D = 128,
# 32x32 tiles over 8 warps spill 1.5 / 3.6 / 2.5 KB (fwd / dK dV / dQ) against 30 / 9.9 KB for 64x32 over 4;
# D = 16 keeps 64x32 over 4 warps (fwd no spill). Untimed.
for _d in (16, 32, 64, 128, 256):
    _m, _w = (64, 4) if _d == 16 else (32, 8)
    _note = _ATTN_NEW.format("true-fp32 FMA tiles, sized by offline sm90 compiles")
    register("attention_fwd", "fp32", "sm90", _cfg(_w, 1, BLOCK_M=_m, BLOCK_N=32, TMA=0, note=_note), (_d,))
    register("attention_bwd_dkdv", "fp32", "sm90", _cfg(_w, 1, BLOCK_M=32, BLOCK_N=_m, TMA=0, note=_note), (_d,))
    register("attention_bwd_dq", "fp32", "sm90", _cfg(_w, 1, BLOCK_M=_m, BLOCK_N=32, TMA=0, note=_note), (_d,))

# linear: BLOCK_R (reduced-dim block) is one value per (dtype, arch) for every weight shape, so fused qkv == q, k, v.
_LINEAR_ANY = "interpreter-sized (ragged tails at test shapes); non-Hopper GPUs run the pointer kernel with these"
for _dt in ("bf16", "fp16", "fp32"):
    register("linear_fwd", _dt, "any", _cfg(4, BLOCK_I=16, BLOCK_J=16, BLOCK_R=32, GROUP_I=2, UNIT=0, TMA=0,
                                            EPI_SPLIT=0, note=_LINEAR_ANY))
    register("linear_dx", _dt, "any", _cfg(4, BLOCK_I=16, BLOCK_J=16, BLOCK_R=16, GROUP_I=2, UNIT=0, TMA=0,
                                           EPI_SPLIT=0, note=_LINEAR_ANY))
    register("linear_dw", _dt, "any", _cfg(4, BLOCK_I=16, BLOCK_J=16, BLOCK_R=8, GROUP_I=2, UNIT=16, TMA=0,
                                           EPI_SPLIT=0, note=_LINEAR_ANY + "; UNIT = dW token unit"))
    register("linear_dbias", _dt, "any", _cfg(4, BLOCK_N=16, BLOCK_R=8, UNIT=16, note=_LINEAR_ANY))
# sm90 entries: chosen on one H200 (torch 2.11, triton 3.6) by `bench_linear.py --sweep`, candidates timed against
# cuBLAS at M = 4096/16384/32768, best worst-case ratio kept (benchmarks/results/linear_h200_run2.json).
_LINEAR_SM90 = "H200 sweep, run 2: best worst-case ratio to cuBLAS over M"
# TAIL_SPLIT (half-width tiles for a partial last round of the persistent walk) and PER_TILE (one program
# per tile, for dW on a side stream beside dX while dX is at most 4 rounds of the SMs; the persistent walk
# after dX otherwise: flowlock.ops.linear.triton.linear_dx_dw, runs_beside) move no arithmetic. STREAM_K
# (the kernel's exact stream-K, same bits) is a sweep candidate only: faster alone for dX at M = 925, no
# faster in the model step, where dW beside dX already fills those SMs (docs/performance.md).
# GLUON: the forward and dX run on the warp-specialized Gluon kernel (flowlock.ops.linear.gluon; same tiles,
# walk and bits as the Triton TMA kernel, RING = its ring depth): 0.99 of the Triton kernel's time at
# 256-wide tiles for every H3 shape and M in {925, 4253, 16384}, and 0.91-0.93 for the N = 5376 forwards
# (out, fc2) at M = 4253 / 16384, which the Triton kernel ran 128 wide (1.03-1.05 at M = 925; H200,
# benchmarks/results/linear_gluon_h200_12e8f8f_{frozen_tile,wide}.json). dW keeps the Triton kernel (token units).
# STREAM_PANELS: the forward at one row group of 1-1.5 rounds of tiles (out / fc2 at M = 925) shares its column
# panels' steps among groups of programs (flowlock.ops.linear.gluon_stream; the walk's bits): 0.895 / 0.825 of
# the walk queued, 1.04 / 0.91 with host time (benchmarks/results/linear_gluon_stream_h200_73c17e3.json).
# fp16 takes the bf16 tiles untimed: the same operand bytes and tensor-core rate, the same fp32 accumulator
for _dt in ("bf16", "fp16"):
    _note = _LINEAR_SM90 if _dt == "bf16" else "bf16 tiles, untimed for fp16"
    register("linear_fwd", _dt, "sm90", _cfg(8, 3, BLOCK_I=128, BLOCK_J=256, BLOCK_R=64, GROUP_I=8, UNIT=0, TMA=1,
                                             EPI_SPLIT=1, FLATTEN=1, TAIL_SPLIT=1, GLUON=1, RING=3, STREAM_PANELS=1,
                                             note=_note))
    register("linear_dx", _dt, "sm90", _cfg(8, 3, BLOCK_I=128, BLOCK_J=256, BLOCK_R=64, GROUP_I=8, UNIT=0, TMA=1,
                                            EPI_SPLIT=1, FLATTEN=1, TAIL_SPLIT=1, GLUON=1, RING=3, note=_note))
    register("linear_dw", _dt, "sm90", _cfg(8, 3, BLOCK_I=128, BLOCK_J=256, BLOCK_R=64, GROUP_I=8, UNIT=1024, TMA=1,
                                            EPI_SPLIT=1, FLAT_UNITS=1, TAIL_SPLIT=1, PER_TILE=1,
                                            note=_note + "; UNIT = dW token unit; PER_TILE: runs beside dX"))
    register("linear_dbias", _dt, "sm90", _cfg(4, BLOCK_N=64, BLOCK_R=64, UNIT=1024, note="by design; ran, not timed"))
for _op, _unit in (("linear_fwd", 0), ("linear_dx", 0), ("linear_dw", 1024)):
    register(_op, "fp32", "sm90", _cfg(4, 3, BLOCK_I=64, BLOCK_J=64, BLOCK_R=32, GROUP_I=8, UNIT=_unit, TMA=1,
                                       EPI_SPLIT=0, note="true-fp32 FMA dot (no TF32), small modules; by design"))
register("linear_dbias", "fp32", "sm90", _cfg(4, BLOCK_N=64, BLOCK_R=64, UNIT=1024, note="by design; ran, not timed"))

# adaln (adaln_table / adaln_modulation / final_adaln_out): chosen by design for the weight-streaming
# memory roof on sm90 (not yet measured on an H200); the "any" entries keep interpreter runs small.
for _dt in ("bf16", "fp16", "fp32"):
    _new = "" if _dt == "bf16" else f"; {_dt} takes the bf16 tiles, untimed"
    register("adaln_proj_fwd", _dt, "any", _cfg(4, BLOCK_T=16, BLOCK_N=32, BLOCK_K=16,
                                                note="interpreter-sized; K tiles of 16 exercise masked tails"))
    register("adaln_proj_fwd", _dt, "sm90", _cfg(4, 4, BLOCK_T=16, BLOCK_N=128, BLOCK_K=64,
                                                 note="H200 sweep: 54 us vs 88 us for 64x128 at N=6H" + _new))
    register("adaln_proj_bwd_act", _dt, "any", _cfg(4, BLOCK_T=16, BLOCK_N=16, BLOCK_K=32, CHUNK_N=80,
                                                    note="interpreter-sized; several N chunks, ragged last"))
    register("adaln_proj_bwd_act", _dt, "sm90", _cfg(4, 3, BLOCK_T=16, BLOCK_N=64, BLOCK_K=128, CHUNK_N=4096,
                                                     note="24 fixed N chunks x 21 K tiles at H3 dims; H200 sweep "
                                                          "(bf16, split product): 195 us at T=2, 255 us for 64x64, "
                                                          "684 us for the true-fp32 product" + _new))
    register("adaln_proj_bwd_weight", _dt, "any", _cfg(4, BLOCK_N=32, BLOCK_K=16, note="interpreter-sized"))
    register("adaln_proj_bwd_weight", _dt, "sm90", _cfg(4, 1, BLOCK_N=64, BLOCK_K=128,
                                                        note="dW written once; T rows streamed per tile" + _new))
register("adaln_gather", "fp32", "any", _cfg(4, BLOCK_S=16, BLOCK_H=32, note="row gather, memory-bound"))
register("adaln_gather", "fp32", "sm90", _cfg(4, BLOCK_S=4, BLOCK_H=512,
                                              note="all six chunks per program, 512-wide rows; by design"))
