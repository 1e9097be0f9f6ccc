"""H3's timestep path: the sinusoid (256 channels in H3; bitwise diffusers) and the FP32 timestep MLP."""

from flowlock.ops.timestep.api import timestep_mlp, timestep_sinusoid

__all__ = ["timestep_mlp", "timestep_sinusoid"]
