"""flowlock inside verl-omni's MiniMax-H3 DiffusionNFT and FlowGRPO runs.

verl-omni's switch is ``external_lib=flowlock.integrations.verl_omni.register`` on the actor and the
rollout (with ``FLOWLOCK_VLLM_OMNI=strict`` in the rollout workers): :mod:`.register` subclasses
verl-omni's H3 adapters and is the only module here that imports verl-omni. Everything it calls
lives in modules that need no verl-omni import:

* :mod:`.rollout`: the strict sampling loop of one request (:func:`~.rollout.cps_rollout`) and
  verl-omni's SDE window (:func:`~.rollout.sde_window`);
* :mod:`.vllm_request`: one t2va request sampled on vLLM-Omni's native DiT, with the layout fields
  of verl-omni's record;
* :mod:`.actor`: the strict actor (patched on first use, identity-checked), the FlowGRPO replay in
  verl-omni's output contract, the DiffusionNFT per-sample layout, the LoRA config refusals;
* :mod:`.record`: verl-omni's H3 rollout record -> the strict forward's keyword arguments and the
  CPS replay's inputs, fail-closed;
* :mod:`.noise`: a request's keyed SDE noise and the record fields that regenerate it;
* :mod:`.sync`: full-weight and LoRA sync into the rollout's DiT, bitwise or refused.

Importing this package imports neither verl-omni, vLLM, vLLM-Omni nor tensordict. See
docs/verl_omni.md.
"""

from flowlock.integrations.verl_omni.noise import RequestNoise, packed_step_noise
from flowlock.integrations.verl_omni.record import ReplayResult, ReplayStep, replay_log_prob, replay_step, row_widths

__all__ = ["ReplayResult", "ReplayStep", "RequestNoise", "packed_step_noise", "replay_log_prob", "replay_step",
           "row_widths"]
