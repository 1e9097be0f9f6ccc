"""The timestep MLP forward as one launch per layer (test-only kernel around the same tile code), the
baseline the one-launch forward must equal bit for bit."""

import torch
import triton
import triton.language as tl

from flowlock.dispatch import interpreter_active
from flowlock.ops.timestep import triton as timestep_triton


@triton.jit
def _layer_kernel(a_ptr, w_ptr, bias_ptr, pre_ptr, out_ptr, M, N, K, EPILOGUE: tl.constexpr, ROWS: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr):
    timestep_triton._gemv_tile(tl.program_id(0), a_ptr, w_ptr, bias_ptr, pre_ptr, out_ptr, M, N, K, K, 1,
                               EPILOGUE, ROWS, BLOCK_N, BLOCK_K, INTERPRET)


def per_layer_forward(x, w1, b1, w2, b2, second_input=None):
    """``(out, h, act)`` from two launches, linear_1 + SiLU then linear_2 (on ``second_input`` when
    given instead of ``act``: a planted fault for the comparison's own test)."""
    rows, hidden, embed = x.shape[0], w1.shape[0], w2.shape[0]
    h = torch.empty(rows, hidden, dtype=torch.float32, device=x.device)
    act = torch.empty_like(h)
    out = torch.empty(rows, embed, dtype=torch.float32, device=x.device)
    block_rows, block_n, kwargs = timestep_triton._mlp_fwd_args(x)
    row_blocks = triton.cdiv(rows, block_rows)
    kwargs = {k: v for k, v in kwargs.items() if k != "INTERPRET"} | {"INTERPRET": interpreter_active()}
    _layer_kernel[(triton.cdiv(hidden, block_n) * row_blocks,)](x, w1, b1, h, act, rows, hidden, x.shape[1],
                                                                EPILOGUE=1, **kwargs)
    _layer_kernel[(triton.cdiv(embed, block_n) * row_blocks,)](act if second_input is None else second_input, w2,
                                                               b2, None, out, rows, embed, hidden, EPILOGUE=0,
                                                               **kwargs)
    return out, h, act
