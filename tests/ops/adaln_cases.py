"""Seeded inputs shared by the adaln test files."""

import torch


def adaln_params(t, e, h, seed=0):
    """``(temb (t, e) fp32, weight (18h, e) bf16, bias (18h,) bf16)``: a 3-modality table's projection."""
    g = torch.Generator().manual_seed(seed)
    temb = torch.randn(t, e, generator=g) * 2
    weight = (torch.randn(18 * h, e, generator=g) * 0.2).to(torch.bfloat16)
    bias = (torch.randn(18 * h, generator=g) * 0.2).to(torch.bfloat16)
    return temb, weight, bias
