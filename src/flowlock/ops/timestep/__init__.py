"""H3's timestep path: the 256-channel sinusoid (bitwise diffusers) and the FP32 timestep MLP."""

from flowlock.ops.timestep.api import timestep_mlp, timestep_sinusoid

__all__ = ["timestep_mlp", "timestep_sinusoid"]
