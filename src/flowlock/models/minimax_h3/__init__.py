"""MiniMax-H3: packed layouts, the tiny random-weight model used by tests and the demo."""

from flowlock.models.minimax_h3.packing import H3Packing, build_packing, packing_for_length
from flowlock.models.minimax_h3.tiny import TINY_H3_CONFIG, full_width_config, make_h3, tiny_h3, tiny_inputs

__all__ = [
    "H3Packing", "TINY_H3_CONFIG", "build_packing", "full_width_config", "packing_for_length", "make_h3", "tiny_h3",
    "tiny_inputs",
]
