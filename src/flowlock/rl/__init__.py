"""RL pieces for exactly on-policy flow-matching RL: sigma grids, keyed noise, transitions with
log-probs, deterministic per-sample means, GRPO / DiffusionNFT losses and trajectory artifacts. The
package knows no model: the rollout/replay consistency run that drives H3 through these pieces is
:mod:`flowlock.validate.consistency`. Importing this package has no side effects."""

from flowlock.rl.losses import NFTLoss, diffusion_nft_loss, flow_grpo_loss, flow_grpo_terms, grpo_advantages
from flowlock.rl.minimax_h3 import H3Schedules, h3_schedules
from flowlock.rl.noise import batch_noise, initial_latents, noise
from flowlock.rl.reduction import fixed_order_mean
from flowlock.rl.schedules import sigma_grid, timesteps_from_sigmas
from flowlock.rl.trajectory import Difference, Trajectory, compare, tensor_hash
from flowlock.rl.transitions import TransitionResult, cps_step, joint_log_prob, ode_step, sde_step

__all__ = [
    "Difference",
    "H3Schedules",
    "NFTLoss",
    "Trajectory",
    "TransitionResult",
    "batch_noise",
    "compare",
    "cps_step",
    "diffusion_nft_loss",
    "fixed_order_mean",
    "flow_grpo_loss",
    "flow_grpo_terms",
    "grpo_advantages",
    "h3_schedules",
    "initial_latents",
    "joint_log_prob",
    "noise",
    "ode_step",
    "sde_step",
    "sigma_grid",
    "tensor_hash",
    "timesteps_from_sigmas",
]
