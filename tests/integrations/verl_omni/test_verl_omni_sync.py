"""The rollout side of verl-omni's H3 weight sync (``integrations.verl_omni.sync``) on the real vLLM-Omni
``MiniMaxH3DiTModel``: full weights in buckets land as ``flowlock convert`` maps them and give the
actor's strict forward bit for bit, before and after an optimizer update; every refused bucket leaves
the model untouched; an unmerged LoRA update (twice, through one manager) and a merged one give the
rollout the actor's bits; LoRA configs the rollout cannot compute exactly are refused before any
layer is wrapped."""

import pytest
import torch
from engine_inputs import ENGINE_CONFIG, diffusers_kwargs, make_request, native_kwargs
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict
from vllm_omni_env import build_native

import flowlock
from flowlock.checkpoint import CheckpointError, diffusers_to_native
from flowlock.integrations.verl_omni.sync import FullSync, add_lora, load_full_weights, merged_weights
from flowlock.integrations.vllm_omni import install
from flowlock.integrations.vllm_omni.lora import is_lora_layer
from flowlock.models.common.peft_lora import is_peft_lora
from flowlock.models.minimax_h3 import make_h3

TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"]
# scale 8 / 4 = 16 / 8 = 2: folds into lora_B exactly; ff.net.2 at another rank than the rest
LORA = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, rank_pattern={"ff.net.2": 8},
                  alpha_pattern={"ff.net.2": 16})
QKV = "transformer.transformer_blocks.0.attn.to_{}.weight"


def _sent(model) -> list[tuple[str, torch.Tensor]]:
    """The actor's full weights as verl-omni sends them: diffusers names under ``transformer.``."""
    return [(f"transformer.{name}", tensor) for name, tensor in model.state_dict().items()]


def _buckets(pairs, n=3):
    # round-robin: consecutive to_q / to_k / to_v of a block land in different buckets
    return [pairs[i::n] for i in range(n)]


def _converted(model):
    """A native model holding what ``flowlock convert`` maps the actor's weights to."""
    native = build_native(ENGINE_CONFIG)
    native.load_state_dict(diffusers_to_native(model.state_dict(), ENGINE_CONFIG, qkv_layout="stacked"), strict=True)
    return native


def _snapshot(native):
    return {name: t.clone() for name, t in native.state_dict().items()}


def _assert_state(native, expected: dict):
    state = native.state_dict()
    assert list(state) == list(expected)
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name


def _forwards(actor, native, request):
    """(rollout rows, actor rows) of one request, both strict."""
    with flowlock.patch(actor), install(native), torch.no_grad(), flowlock.mode("strict") as frame:
        rollout = native(**native_kwargs([request]))
        out = actor(**diffusers_kwargs(request))
    assert frame.fallbacks == []
    return tuple(rollout), (out.sample[0] * request.branch.update_mask.unsqueeze(-1), out.audio_sample[0])


def _assert_same_bits(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert torch.equal(a, e)


def _full_sync(native, pairs):
    sync = FullSync(native)
    written = set().union(*(sync.load(bucket) for bucket in _buckets(pairs)))
    return written, sync.finish()


def test_three_buckets_give_the_converted_model_and_the_actors_forward():
    actor = make_h3(ENGINE_CONFIG, seed=0)
    pairs = _sent(actor)
    homes = [next(i for i, b in enumerate(_buckets(pairs)) if any(n == QKV.format(p) for n, _ in b)) for p in "qkv"]
    assert len(set(homes)) == 3  # one q/k/v group is spread over the three buckets
    native = build_native(ENGINE_CONFIG)  # dummy weights: NaN-poisoned, rope.inv_freq included
    written, everything = _full_sync(native, pairs)
    assert written == {name for name, _ in native.named_parameters()}
    assert everything == set(native.state_dict())
    _assert_state(native, _converted(actor).state_dict())
    _assert_same_bits(*_forwards(actor, native, make_request(seed=1, seq_len=25)))


def test_an_optimizer_update_reaches_the_rollout():
    actor = make_h3(ENGINE_CONFIG, seed=1)
    native = build_native(ENGINE_CONFIG, actor.state_dict())
    before = _snapshot(native)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():  # in place, as an optimizer step writes
        for p in actor.parameters():
            p.add_((torch.randn(p.shape, generator=gen) * 0.05).to(p.dtype))
    _full_sync(native, _sent(actor))
    after = native.state_dict()
    assert all(not torch.equal(after[name], before[name]) for name, _ in native.named_parameters())
    _assert_state(native, _converted(actor).state_dict())
    _assert_same_bits(*_forwards(actor, native, make_request(seed=2)))


def test_vllm_omnis_own_forward_sees_the_synced_weights():
    native = build_native(ENGINE_CONFIG, make_h3(ENGINE_CONFIG, seed=0).state_dict())
    new = make_h3(ENGINE_CONFIG, seed=4)
    request = make_request(seed=1)
    with torch.no_grad():
        native(**native_kwargs([request]))  # fills vLLM-Omni's AdaLN memo cache from the old weights
        _full_sync(native, _sent(new))
        synced = native(**native_kwargs([request]))
        fresh = build_native(ENGINE_CONFIG, new.state_dict())(**native_kwargs([request]))
    _assert_same_bits(synced, fresh)


def test_a_widening_cast_is_carried_exactly():
    actor, other = make_h3(ENGINE_CONFIG, seed=1), make_h3(ENGINE_CONFIG, seed=3)
    native = build_native(ENGINE_CONFIG, actor.state_dict())
    bf16 = other.state_dict()["transformer_blocks.1.ff.net.2.weight"]
    load_full_weights(native, [("transformer.transformer_blocks.1.ff.net.2.weight", bf16.float())])
    assert native.blocks[1].mlp.fc2.weight.dtype == torch.bfloat16
    assert torch.equal(native.blocks[1].mlp.fc2.weight, bf16)


def _with(pairs, name, tensor):
    return [*pairs, (name, tensor)]


def _replace(pairs, name, change):
    return [(n, change(t) if n == name else t) for n, t in pairs]


def _nan(t):
    t = t.clone()
    t[1, 2] = float("nan")
    return t


def _inf(t):
    t = t.clone()
    t[0, 0] = float("inf")
    return t


def _off_bf16(t):
    # an FP32 value between two BF16 neighbours: the cast to the BF16 parameter would round it
    return t.float() * (1 + 2.0 ** -12)


Q = QKV.format("q")
REFUSED = {
    "unknown": (lambda p: _with(p, "transformer.transformer_blocks.0.attn.to_x.weight", p[0][1]),
                "no such tensor in the H3 name table"),
    "outside_component": (lambda p: _with(p, "transformer_blocks.0.norm1.weight", p[0][1]), "not under 'transformer.'"),
    "lora_factor": (lambda p: _with(p, "transformer.transformer_blocks.0.attn.to_q.lora_A.weight",
                                    torch.zeros(4, 64, dtype=torch.bfloat16)), "a LoRA factor"),
    "twice": (lambda p: _with(p, Q, dict(p)[Q]), "written twice in one sync"),
    "shape": (lambda p: _replace(p, Q, lambda t: t[:-1]), r"shape \[255, 64\], the table gives \[256, 64\]"),
    "nan": (lambda p: _replace(p, Q, _nan), "1 of 16384 elements are not finite"),
    "inf": (lambda p: _replace(p, Q, _inf), "1 of 16384 elements are not finite"),
    "inexact_cast": (lambda p: _replace(p, Q, _off_bf16), r"torch.float32 -> torch.bfloat16 rounds \d+ of 16384"),
    "not_floating": (lambda p: _replace(p, Q, lambda t: t.to(torch.int32)), "want a floating tensor"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_refused_bucket_writes_nothing(case):
    native = build_native(ENGINE_CONFIG, make_h3(ENGINE_CONFIG, seed=0).state_dict())
    before = _snapshot(native)
    # every other tensor of the bucket carries new bits, so any write would show
    bucket, reason = REFUSED[case]
    pairs = bucket(_sent(make_h3(ENGINE_CONFIG, seed=4))[:40])
    with pytest.raises(CheckpointError, match=reason):
        load_full_weights(native, pairs)
    with pytest.raises(CheckpointError, match=reason):
        FullSync(native).load(pairs)
    _assert_state(native, before)


def test_a_tensor_sent_twice_in_one_sync_refuses_its_bucket():
    native = build_native(ENGINE_CONFIG, make_h3(ENGINE_CONFIG, seed=0).state_dict())
    first, second = _buckets(_sent(make_h3(ENGINE_CONFIG, seed=4)), 2)
    sync = FullSync(native)
    sync.load(first)
    after_first = _snapshot(native)
    with pytest.raises(CheckpointError, match=f"{first[0][0]}: written twice in one sync"):
        sync.load([*second, first[0]])
    _assert_state(native, after_first)


def test_finish_refuses_a_sync_that_missed_a_tensor():
    native = build_native(ENGINE_CONFIG, make_h3(ENGINE_CONFIG, seed=0).state_dict())
    pairs = _sent(make_h3(ENGINE_CONFIG, seed=4))
    missed = "transformer_blocks.1.attn.to_v.weight"
    sync = FullSync(native)
    sync.load([(n, t) for n, t in pairs if n != f"transformer.{missed}"])
    with torch.no_grad():
        native.rope.inv_freq.zero_()  # as a dummy-loaded model: finish() must not write it when it refuses
    before = _snapshot(native)
    with pytest.raises(CheckpointError, match=f"never sent 1: {missed}"):
        sync.finish()
    _assert_state(native, before)


def test_a_sharded_native_model_is_refused():
    native = build_native(ENGINE_CONFIG, make_h3(ENGINE_CONFIG, seed=0).state_dict())
    qkv = native.blocks[0].attn.qkv_proj
    qkv.weight = torch.nn.Parameter(qkv.weight.data[: qkv.weight.shape[0] // 2].clone(), requires_grad=False)
    before = _snapshot(native)
    with pytest.raises(CheckpointError, match=r"blocks.0.attn.qkv_proj.weight: shape \[384, 64\], the table gives"):
        load_full_weights(native, _sent(make_h3(ENGINE_CONFIG, seed=4)))
    _assert_state(native, before)


# --------------------------------------------------------------------------------------------- LoRA

def _train(model, seed):
    """New values in every LoRA factor, as after an optimizer step (peft starts lora_B at zero)."""
    gen = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if is_peft_lora(module):
            for factor in (module.lora_A["default"], module.lora_B["default"]):
                factor.weight.data = (torch.randn(factor.weight.shape, generator=gen) * 0.2).to(torch.bfloat16)


@pytest.fixture
def lora_actor():
    actor = make_h3(ENGINE_CONFIG, seed=2)
    base = actor.state_dict()
    actor.add_adapter(LORA)
    return actor, base


def test_unmerged_lora_updates_give_the_rollout_the_actors_bits(lora_actor):
    actor, base = lora_actor
    native = build_native(ENGINE_CONFIG, base)
    request = make_request(seed=3, seq_len=25)
    manager, previous = None, None
    for step in range(2):
        _train(actor, seed=10 + step)
        manager = add_lora(native, get_peft_model_state_dict(actor), LORA, manager=manager)
        rollout, expected = _forwards(actor, native, request)
        _assert_same_bits(rollout, expected)
        if previous is not None:  # the update reached the rollout
            assert not torch.equal(rollout[0], previous[0])
        previous = rollout


REFUSED_LORA = {
    "target_outside": ({"target_modules": [*TARGETS, "proj_out"]}, ValueError, "do not wrap 1: proj_out"),
    "target_suffix_too_wide": ({"target_modules": ["linear"]}, ValueError, "adaln_proj.linear"),
    "all_linear": ({"target_modules": "all-linear"}, ValueError, "name the LoRA targets explicitly"),
    "dropout": ({"lora_dropout": 0.1}, ValueError, "lora_dropout = 0.1"),
    "dora": ({"use_dora": True}, ValueError, "use_dora = True"),
    "modules_to_save": ({"modules_to_save": ["proj_out"]}, ValueError, "modules_to_save"),
    "scale": ({"lora_alpha": 6, "alpha_pattern": {}}, flowlock.StrictModeError, "is not a power of two"),
}


@pytest.mark.parametrize("case", list(REFUSED_LORA))
def test_a_lora_the_rollout_cannot_compute_exactly_is_refused_before_wrapping(lora_actor, case):
    actor, base = lora_actor
    _train(actor, seed=1)
    native = build_native(ENGINE_CONFIG, base)
    before = _snapshot(native)
    change, error, reason = REFUSED_LORA[case]
    with pytest.raises(error, match=reason):
        add_lora(native, get_peft_model_state_dict(actor), {**LORA.to_dict(), **change})
    assert not any(is_lora_layer(m) for m in native.modules())
    _assert_state(native, before)


def test_merged_lora_reaches_the_rollout_bitwise(lora_actor):
    actor, base = lora_actor
    _train(actor, seed=5)
    merged = list(merged_weights(actor))
    assert [n for n, _ in merged] == [f"transformer.{n}" for n in base]
    # the fixed merge arithmetic: B @ A to FP32, times the scale, plus W in FP32, one rounding to W's dtype
    layer = actor.transformer_blocks[1].ff.net[0].proj
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    expected = ((b.double() @ a.double()).float() * 2 + layer.base_layer.weight.float()).to(torch.bfloat16)
    assert torch.equal(dict(merged)["transformer.transformer_blocks.1.ff.net.0.proj.weight"], expected)
    assert not torch.equal(expected, layer.base_layer.weight)

    native = build_native(ENGINE_CONFIG)
    _full_sync(native, merged)
    actor_merged = make_h3(ENGINE_CONFIG, seed=9)  # the actor computing with the same merged weights
    actor_merged.load_state_dict({n.removeprefix("transformer."): t for n, t in merged}, strict=True)
    _assert_same_bits(*_forwards(actor_merged, native, make_request(seed=6)))


def test_a_lora_merged_by_peft_or_a_dora_is_refused(lora_actor):
    actor, _ = lora_actor
    actor.transformer_blocks[0].attn.to_k.merge()
    with pytest.raises(ValueError, match="transformer_blocks.0.attn.to_k: peft merged it already"):
        merged_weights(actor)
    dora = make_h3(ENGINE_CONFIG, seed=2)
    dora.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=["to_q"], use_dora=True))
    with pytest.raises(ValueError, match="transformer_blocks.0.attn.to_q: adapter 'default' is a LoRA variant"):
        merged_weights(dora)


def test_syncs_delivered_as_verl_omni_delivers_them_end_themselves_and_a_short_one_is_refused():
    """Buckets of the whole pipeline (other components, LoRA factors mixed in), no end-of-sync call:
    each sync finishes when its last tensor arrives; one that ends short is refused by the next."""
    from flowlock.integrations.verl_omni.sync import RolloutSyncs

    actor = make_h3(ENGINE_CONFIG, seed=2)
    native = build_native(ENGINE_CONFIG)
    syncs = RolloutSyncs(native)
    other = ("vae.decoder.conv.weight", torch.ones(2))
    factor = ("transformer.transformer_blocks.0.attn.to_q.lora_A.weight", torch.ones(2, 2))
    buckets = _buckets(_sent(actor))
    written, others = syncs.load(buckets[0] + [other, factor])
    assert others == [other] and not any(".lora_" in name for name in written)
    for bucket in buckets[1:]:
        written |= syncs.load(bucket)[0]
    assert written == {f"transformer.{name}" for name in native.state_dict()}
    _assert_state(native, _converted(actor).state_dict())
    syncs.load(buckets[0])  # a second sync starts, and ends short
    before = _snapshot(native)
    with pytest.raises(CheckpointError, match="twice"):
        syncs.load(buckets[0])
    _assert_state(native, before)
