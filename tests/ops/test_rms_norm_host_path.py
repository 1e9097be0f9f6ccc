"""rms_norm / rms_norm_modulate host path: calls that need no graph skip the autograd Function with the
same bits, and the modulated backward's three gradients share one partials buffer and one fold with
the bits of the separate launches it replaced."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from rms_norm_cases import modulate_case

import flowlock
from flowlock.config import config_for, launch_config
from flowlock.ops.rms_norm import rms_norm, rms_norm_modulate
from flowlock.ops.rms_norm import triton as rt
from flowlock.ops.segment_sum import fold as fold_module
from flowlock.ops.segment_sum import triton as st_module
from flowlock.ops.segment_sum.fold import fold_partials
from flowlock.ops.segment_sum.triton import segment_sum_fwd
from flowlock.testing import assert_bitwise_equal

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("lead,s,h", [((), 1, 24), ((2,), 7, 40), ((3,), 33, 24)])
def test_no_graph_output_equals_graph_output(lead, s, h):
    x, weight, table, index, _ = modulate_case(lead, s, h, 3, torch.bfloat16)
    shift, scale = table[:, :h], table[:, h:2 * h]
    with flowlock.use_backend("triton"):
        with torch.no_grad():
            plain, modulated = rms_norm(x, weight, 1e-5), rms_norm_modulate(x, weight, shift, scale, index, 1e-5)
        leaf = x.detach().clone().requires_grad_(True)
        plain_graph = rms_norm(leaf, weight, 1e-5)
        modulated_graph = rms_norm_modulate(leaf, weight, shift, scale, index, 1e-5)
    assert plain.grad_fn is None and modulated.grad_fn is None
    assert plain_graph.grad_fn is not None and modulated_graph.grad_fn is not None
    assert torch.equal(plain, plain_graph.detach()) and torch.equal(modulated, modulated_graph.detach())


def _separate_launches(dy, x, weight, rstd, shift, scale, index):
    """The modulated backward as it ran before: the norm's own (tiles, H) dweight partials and fold,
    then one segment sum per table gradient (each its own partials launch and fold)."""
    h = x.shape[-1]
    m = x.numel() // h
    cfg = config_for("rms_norm_bwd", x)
    tiles = max(-(-m // cfg["TILE_ROWS"]), 1)
    dx = torch.empty_like(x)
    partials = torch.empty((tiles, h), dtype=torch.float32, device=x.device)
    normed = torch.empty((m, h), dtype=x.dtype, device=x.device)
    dtype = rt._TL_DTYPE[x.dtype]
    rt._rms_norm_bwd_dx_kernel[(-(-m // cfg["DX_ROWS"]),)](
        x, weight, dy, rstd, scale, index, dx, normed, m, h, index.shape[0], scale.stride(0), float(h),
        HAS_MOD=True, DTYPE=dtype, ROWS=cfg["DX_ROWS"], BLOCK_H=rt._block_h(h), num_warps=cfg.num_warps)
    rt._rms_norm_bwd_dw_kernel[(tiles, -(-h // cfg["BLOCK_C"]))](
        x, dy, rstd, scale, index, partials, m, h, index.shape[0], scale.stride(0), h,
        HAS_MOD=True, DTYPE=dtype, TILE_ROWS=cfg["TILE_ROWS"], SUB_ROWS=cfg["SUB_ROWS"], BLOCK_C=cfg["BLOCK_C"],
        num_warps=cfg["DW_WARPS"])
    rows = dy.reshape(m, h)
    dshift = segment_sum_fwd(rows, index, shift.shape[0], period=index.shape[0])
    dscale = segment_sum_fwd(rows, index, shift.shape[0], other=normed, period=index.shape[0])
    return dx, fold_partials(partials), dshift, dscale


def _shared_fold_equals_separate(lead, s, h, r, dtype, seed, device):
    x, weight, table, index, dy = modulate_case(lead, s, h, r, dtype, seed, device)
    shift, scale = table[:, :h], table[:, 3 * h:4 * h]
    with flowlock.use_backend("triton"):
        _, rstd = rt.rms_norm_fwd(x, weight, 1e-5, shift, scale, index)
        new = rt.rms_norm_bwd(dy, x, weight, rstd, shift, scale, index)
        old = _separate_launches(dy, x, weight, rstd, shift, scale, index)
    assert_bitwise_equal(new, old, "(dx, dweight, dshift, dscale)")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lead,s,h,r", [((), 1, 24, 1), ((2,), 33, 40, 3), ((3,), 70, 24, 9)])
def test_modulated_backward_equals_separate_launches(lead, s, h, r, device):
    _shared_fold_equals_separate(lead, s, h, r, torch.bfloat16, 0, device)


@settings(max_examples=6, deadline=None)
@given(lead=st.sampled_from([(), (2,)]), s=st.sampled_from([1, 7, 33]), h=st.sampled_from([8, 24, 40]),
       r=st.integers(1, 5), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       seed=st.integers(0, 2**16))
def test_modulated_backward_equals_separate_launches_hypothesis(lead, s, h, r, dtype, seed):
    _shared_fold_equals_separate(lead, s, h, r, dtype, seed, "cpu")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lead,s,h", [((2,), 70, 40), ((), 33, 24)])
def test_dweight_column_block_moves_no_arithmetic(lead, s, h, device):
    """With the tile's rows summed one by one (SUB_ROWS = 1, the sm90 arrangement), each column's
    dweight partial is the same chain of additions whatever BLOCK_C the columns are cut into, so the
    backward's every output keeps its bits (BLOCK_C 4 to 64, H = 24 / 40 not a multiple of 16 or 64)."""
    assert launch_config("rms_norm_bwd", torch.bfloat16, "sm90")["SUB_ROWS"] == 1
    x, weight, table, index, dy = modulate_case(lead, s, h, 3, torch.bfloat16, 5, device)
    shift, scale = table[:, :h], table[:, 3 * h:4 * h]
    frozen = config_for("rms_norm_bwd", x)
    runs = []
    with flowlock.use_backend("triton"):
        _, rstd = rt.rms_norm_fwd(x, weight, 1e-5, shift, scale, index)
        for block_c in (64, 16, 4):
            cfg = frozen.with_blocks(SUB_ROWS=1, BLOCK_C=block_c)
            runs.append(rt.rms_norm_bwd(dy, x, weight, rstd, shift, scale, index, config=cfg))
    for block_c, got in zip((16, 4), runs[1:]):
        assert_bitwise_equal(got, runs[0], f"BLOCK_C {block_c} vs 64")


class _Counted:
    """A kernel stand-in that logs each launch by name and runs the real kernel."""

    def __init__(self, kernel, name, log):
        self.kernel, self.name, self.log = kernel, name, log

    def __getitem__(self, grid):
        self.log.append(self.name)
        return self.kernel[grid]


def test_modulated_backward_launches_dx_dweight_pair_partials_and_one_fold(monkeypatch):
    log = []
    for module, name in ((rt, "_rms_norm_bwd_dx_kernel"), (rt, "_rms_norm_bwd_dw_kernel"),
                         (st_module, "_segment_sum_partials_kernel"), (fold_module, "_fold_groups_kernel")):
        monkeypatch.setattr(module, name, _Counted(getattr(module, name), name, log))
    x, weight, table, index, dy = modulate_case((2,), 33, 24, 3, torch.bfloat16)
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, weight, table)]
    with flowlock.use_backend("triton"):
        h = x.shape[-1]
        out = rms_norm_modulate(leaves[0], leaves[1], leaves[2][:, :h], leaves[2][:, h:2 * h], index, 1e-5)
        log.clear()
        out.backward(dy)
    # 66 rows: 2 tiles of 64, folded in one level (interpreter GROUP = 4).
    assert log == ["_rms_norm_bwd_dx_kernel", "_rms_norm_bwd_dw_kernel", "_segment_sum_partials_kernel",
                   "_fold_groups_kernel"]
