"""Both engines serve the same configs: every width the diffusers strict path accepts beyond H3's own
(a sinusoid ``freq_dim`` other than 256, head dims 16 to 256), the vLLM-Omni adapter accepts too,
and gives the diffusers strict path's bits there, in BF16 or FP16 with H3's FP32 modules and in FP32
(the dtypes the attention drop-in serves); a width neither serves (an odd ``freq_dim``) is refused by
both, naming the module."""

import pytest
import torch
from engine_inputs import ENGINE_CONFIG, diffusers_kwargs, make_request, native_kwargs
from vllm_omni_env import build_native

import flowlock
from flowlock.integrations.vllm_omni import install
from flowlock.models.minimax_h3 import make_h3
from flowlock.testing import assert_bitwise_equal

# (head dim, rope_freq_dim) as tests/models/test_h3_dtypes.py: RoPE rotates 6 * rope_freq_dim channels
CONFIGS = {
    "H3 widths": {},
    "freq_dim 128": dict(freq_dim=128),
    "freq_dim 18": dict(freq_dim=18),
    "head_dim 16": dict(attention_head_dim=16, rope_freq_dim=2),
    "head_dim 64": dict(attention_head_dim=64, rope_freq_dim=8),
    "head_dim 256, freq_dim 64": dict(attention_head_dim=256, rope_freq_dim=16, freq_dim=64),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _engines(overrides: dict, dtype: torch.dtype):
    config = {**ENGINE_CONFIG, **overrides}
    diffusers = make_h3(config, seed=0, dtype=dtype)
    return diffusers, build_native(config, diffusers.state_dict(), dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", CONFIGS)
def test_engines_give_the_same_bits_at_every_served_width(name, dtype):
    diffusers, native = _engines(CONFIGS[name], DTYPES[dtype])
    assert native.time_embedder.frequency_embedding_size == diffusers.time_proj.num_channels
    assert native.blocks[0].attn.head_dim == diffusers.transformer_blocks[0].attn.head_dim
    # the models really are in that dtype (the FP32 modules aside)
    assert {p.dtype for p in native.blocks.parameters()} == {p.dtype for p in diffusers.transformer_blocks.parameters()
                                                             } == {DTYPES[dtype]}
    request = make_request(seed=1, seq_len=25, dtype=DTYPES[dtype])
    with flowlock.patch(diffusers), install(native), torch.no_grad(), flowlock.mode("strict") as frame:
        rollout = native(**native_kwargs([request]))
        out = diffusers(**diffusers_kwargs(request))
    # vLLM-Omni returns condition rows zeroed; the trainer masks them itself
    trainer = out.sample[0] * request.branch.update_mask.unsqueeze(-1), out.audio_sample[0]
    assert {"timestep_sinusoid", "attention", "qk_norm_rope"} <= {op for op, _ in frame.ran}
    assert rollout[0].isfinite().all() and rollout[1].isfinite().all()
    assert_bitwise_equal(rollout, trainer, f"{name} {dtype}: vLLM-Omni vs diffusers")


def test_an_odd_sinusoid_width_is_refused_by_both_engines():
    diffusers, native = _engines(dict(freq_dim=17), torch.bfloat16)
    request = make_request(seed=1, seq_len=25)
    with flowlock.patch(diffusers), install(native), torch.no_grad():
        with pytest.raises(flowlock.StrictModeError, match=r"time_proj.*even C only, got C=17"):
            diffusers(**diffusers_kwargs(request))
        with pytest.raises(flowlock.StrictModeError, match=r"time_embedder.*even sinusoid width >= 2, got 17"):
            native(**native_kwargs([request]))
