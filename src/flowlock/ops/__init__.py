"""flowlock's operators: each validated public function dispatches to Triton (CUDA) or its
PyTorch reference (CPU); see ``flowlock.dispatch``.

Every public op is ``flowlock.ops.<op>``. Where an op is named like its family (``attention``,
``linear``, ``rms_norm``, ...), ``flowlock.ops.<name>`` is the op; the family's module stays
importable by its path (``from flowlock.ops.linear import linear_reference``,
``importlib.import_module("flowlock.ops.linear")``).
"""

from flowlock.ops.adaln import adaln_modulation, adaln_table, adaln_table_kept
from flowlock.ops.attention import attention
from flowlock.ops.euler import euler_step
from flowlock.ops.final_adaln import final_adaln_out
from flowlock.ops.gate_residual import gate_residual
from flowlock.ops.linear import linear, linear_weight_grad
from flowlock.ops.qk_norm_rope import qk_norm_rope
from flowlock.ops.rms_norm import rms_norm, rms_norm_modulate
from flowlock.ops.rows import gather_rows, scatter_rows
from flowlock.ops.segment_sum import segment_sum
from flowlock.ops.swiglu import swiglu
from flowlock.ops.timestep import timestep_mlp, timestep_sinusoid

__all__ = [
    "adaln_modulation", "adaln_table", "adaln_table_kept", "attention", "euler_step", "final_adaln_out",
    "gate_residual", "gather_rows", "linear", "linear_weight_grad", "qk_norm_rope", "rms_norm", "rms_norm_modulate",
    "scatter_rows", "segment_sum", "swiglu", "timestep_mlp", "timestep_sinusoid",
]
