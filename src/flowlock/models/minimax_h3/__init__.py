"""MiniMax-H3: packed layouts, the tiny random-weight model used by tests and the demo."""

from flowlock.models.minimax_h3.layout import H3Layout, build_layout
from flowlock.models.minimax_h3.tiny import TINY_H3_CONFIG, make_h3, tiny_h3, tiny_inputs

__all__ = ["H3Layout", "TINY_H3_CONFIG", "build_layout", "make_h3", "tiny_h3", "tiny_inputs"]
