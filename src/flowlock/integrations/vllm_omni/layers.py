"""vLLM's layer classes the strict path computes in place of their own forward, whatever the model.

Imported by a family's coverage (which decides what it serves) and by its tensor-parallel layout
(which checks how those layers are sharded); vLLM is imported with this module.
"""

from __future__ import annotations

from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)

LINEAR_CLASSES = (ColumnParallelLinear, RowParallelLinear, QKVParallelLinear, MergedColumnParallelLinear)
