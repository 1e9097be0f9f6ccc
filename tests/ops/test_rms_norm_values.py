"""Adversarial value builders shared by the norms tests (rms_norm, rms_norm_modulate, gate_residual)."""

import torch

MODES = ("normal", "bits", "ties", "tiny", "huge")


def adversarial(shape, dtype, mode, gen):
    """Finite values of ``dtype`` (returned in ``dtype``): ``normal`` draws, random bit patterns,
    half-way cases for a following add/multiply (``ties``), subnormals (``tiny``), near-overflow (``huge``)."""
    if mode == "normal":
        return torch.randn(shape, generator=gen).to(dtype)
    if mode == "bits":
        if dtype == torch.float32:
            bits = torch.randint(-2**31, 2**31 - 1, shape, generator=gen, dtype=torch.int64).to(torch.int32)
        else:
            bits = torch.randint(-2**15, 2**15 - 1, shape, generator=gen, dtype=torch.int32).to(torch.int16)
        v = bits.view(dtype)
        return torch.where(torch.isfinite(v), v, torch.zeros((), dtype=dtype))
    finfo = torch.finfo(dtype)
    if mode == "ties":
        # Odd multiples of half the resolution at 1: 1 + v and products with such factors land on ties.
        k = torch.randint(-64, 64, shape, generator=gen) * 2 + 1
        return (k.double() * finfo.eps / 2).to(dtype)
    if mode == "tiny":
        return (torch.randn(shape, generator=gen, dtype=torch.float64) * finfo.tiny * 2).to(dtype)
    return (torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1).mul(finfo.max).to(dtype)


def test_adversarial_values_are_finite_and_typed():
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for mode in MODES:
            v = adversarial((64,), dtype, mode, gen)
            assert v.dtype == dtype and bool(torch.isfinite(v).all()), (dtype, mode)
