"""flowlock inside verl-omni's MiniMax-H3 FlowGRPO runs: the parts that need no verl-omni import.

* :mod:`~flowlock.integrations.verl_omni.record`: verl-omni's H3 rollout record (a ``TensorDict``
  micro-batch) -> the strict forward's keyword arguments and the CPS replay's inputs, fail-closed;
  :func:`replay_log_prob` is the actor's strict replay of one transition.
* :mod:`~flowlock.integrations.verl_omni.noise`: a rollout request's keyed SDE noise and the record
  fields that let the actor regenerate it.

Importing this package imports neither verl-omni, vLLM, vLLM-Omni nor tensordict. See
docs/verl_omni.md for the rollout side (the ``vllm.general_plugins`` entry point
:mod:`flowlock.integrations.vllm_omni.plugin`) and what is still to come (the registry classes verl-omni imports through
``external_lib``).
"""

from flowlock.integrations.verl_omni.noise import RequestNoise, packed_step_noise
from flowlock.integrations.verl_omni.record import ReplayResult, ReplayStep, replay_log_prob, replay_step, row_widths

__all__ = ["ReplayResult", "ReplayStep", "RequestNoise", "packed_step_noise", "replay_log_prob", "replay_step",
           "row_widths"]
