"""The MiniMax-H3 wing of the checkpoint package: its geometry, its diffusers <-> native name table,
the q/k/v, fc1 and rope transforms between the two, and the conversion plan built from them.

A second model family gets a sibling folder with the same two entry points for the directory
machinery (:func:`~flowlock.checkpoint.minimax_h3.conversion.plan_directory` and
:func:`~flowlock.checkpoint.minimax_h3.conversion.check_converted`).
"""
