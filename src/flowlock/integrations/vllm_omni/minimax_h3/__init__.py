"""vLLM-Omni's native MiniMax-H3 (``MiniMaxH3DiTModel``) on flowlock's strict path: its patch plan,
coverage, forward, inputs, tensor and sequence parallelism, and the replay of its packed requests
as diffusers calls. The block body is H3's own (:mod:`flowlock.models.minimax_h3.skeleton`),
shared with the diffusers strict path."""
