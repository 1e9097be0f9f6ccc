"""MiniMax-H3: packed layouts, the tiny random-weight model used by tests and the demo."""

from flowlock.models.minimax_h3.layout import H3Layout, build_layout, layout_for_length
from flowlock.models.minimax_h3.tiny import TINY_H3_CONFIG, full_width_config, make_h3, tiny_h3, tiny_inputs

__all__ = [
    "H3Layout", "TINY_H3_CONFIG", "build_layout", "full_width_config", "layout_for_length", "make_h3", "tiny_h3",
    "tiny_inputs",
]
