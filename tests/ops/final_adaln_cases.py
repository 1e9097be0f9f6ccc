"""Seeded inputs shared by the final_adaln_out test files."""

import torch


def final_adaln_inputs(b, s, t, e, h, seed=0, x_scale=3.0):
    """``(x (b, s, h) bf16, temb (t, e) fp32, norm_weight, weight (2h, e), bias, timestep_indices (s,))``."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(b, s, h, generator=g) * x_scale).to(torch.bfloat16)
    temb = torch.randn(t, e, generator=g) * 2
    norm_weight = (torch.rand(h, generator=g) + 0.5).to(torch.bfloat16)
    weight = (torch.randn(2 * h, e, generator=g) * 0.2).to(torch.bfloat16)
    bias = (torch.randn(2 * h, generator=g) * 0.2).to(torch.bfloat16)
    ti = torch.randint(0, t, (s,), generator=g)
    return x, temb, norm_weight, weight, bias, ti
