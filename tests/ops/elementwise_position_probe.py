"""Run in a subprocess by ``test_reference_position_free.py`` (``ATEN_CPU_CAPABILITY`` set by the
caller): prints one JSON line saying which ATen CPU capability runs, whether torch's own float32
transcendental functions give a row other bits beside other rows than alone (the hazard), and
whether flowlock's reference ops that evaluate such functions do (they must not)."""

import json

import torch
import torch.nn.functional as F

from flowlock.models.minimax_h3.strict import rope_cos_sin
from flowlock.ops.adaln.reference import adaln_projection_reference
from flowlock.ops.attention.reference import attention_reference
from flowlock.ops.swiglu.reference import swiglu_reference
from flowlock.ops.timestep.reference import timestep_sinusoid_reference

ROWS = 37  # odd, so a row alone and the rows together leave different tails to the scalar routine


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rows_differ(fn, x: torch.Tensor) -> int:
    """How many rows of ``fn(x)`` (rows on dim 0) differ from ``fn`` of that row alone."""
    full = fn(x)
    return sum(not torch.equal(full[i:i + 1], fn(x[i:i + 1])) for i in range(x.shape[0]))


def hazard() -> dict:
    x = torch.randn(ROWS, 19, generator=_gen(0)) * 3
    return {name: rows_differ(fn, x) for name, fn in
            (("exp2", torch.exp2), ("exp", torch.exp), ("sigmoid", torch.sigmoid), ("silu", F.silu),
             ("rsqrt", lambda t: torch.rsqrt(t.abs())), ("cos", torch.cos), ("sin", torch.sin),
             ("log", lambda t: torch.log(t.abs())))}


def references() -> dict:
    found = {}
    for dtype in (torch.float32, torch.bfloat16):
        tag = str(dtype).removeprefix("torch.")
        q = torch.randn(1, ROWS, 2, 16, generator=_gen(1)).to(dtype)
        k, v = (torch.randn(1, 19, 2, 16, generator=_gen(s)).to(dtype) for s in (2, 3))
        # attention rows are query rows (dim 1): move them to dim 0 for rows_differ
        found[f"attention {tag}"] = rows_differ(
            lambda t, k=k, v=v: attention_reference(t.transpose(0, 1), k, v, 0.25).transpose(0, 1), q.transpose(0, 1))
        weight = (torch.randn(24, 40, generator=_gen(4)) * 0.1).to(dtype)
        bias = (torch.randn(24, generator=_gen(5)) * 0.1).to(dtype)
        temb = torch.randn(ROWS, 40, generator=_gen(6)) * 3
        found[f"adaln projection {tag} weights"] = rows_differ(
            lambda t, w=weight, b=bias: adaln_projection_reference(t, w, b), temb)
    # diffusers' verbatim SiLU is safe here: the gate is a strided half of each row, so ATen loops
    # row by row and every row splits into body and tail alike, whatever the row count.
    h = torch.randn(ROWS, 2 * 21, generator=_gen(7)) * 4
    found["swiglu float32"] = rows_differ(swiglu_reference, h)
    positions = torch.randint(0, 4096, (ROWS, 3), generator=_gen(8))
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    found["rope cos/sin"] = rows_differ(lambda t: torch.cat(rope_cos_sin(inv_freq, t), dim=-1), positions)
    found["timestep sinusoid"] = rows_differ(timestep_sinusoid_reference, torch.rand(ROWS, generator=_gen(9)) * 1000)
    return found


if __name__ == "__main__":
    print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "hazard": hazard(),
                      "references": references()}))
