"""Strict model paths built from flowlock ops. Each family registers its patch plan with the
generic patcher by import path: importing this package imports no family and no model library."""

from flowlock.patching import register_plan

register_plan("diffusers.models.transformers.transformer_minimax_h3.MiniMaxH3Transformer3DModel",
              "flowlock.models.minimax_h3.plan:build_plan")
