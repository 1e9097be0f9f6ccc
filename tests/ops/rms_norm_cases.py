"""Seeded inputs shared by the rms_norm test files."""

import torch


def modulate_case(lead, s, h, r, dtype, seed=0, device="cpu"):
    """``[x (*lead, s, h), weight (h,), table (r, 6h) fp32 holding dtype values, index (s,), dy]``."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*lead, s, h, generator=g) * 3).to(dtype)
    weight = (1 + 0.3 * torch.randn(h, generator=g)).to(dtype)
    table = (0.5 * torch.randn(r, 6 * h, generator=g)).to(dtype).float()
    index = torch.randint(0, r, (s,), generator=g)
    dy = torch.randn(*lead, s, h, generator=g).to(dtype)
    return [t.to(device) for t in (x, weight, table, index, dy)]
