"""timestep_mlp's one-launch forward on a GPU, where its programs really run concurrently: the bits of
one launch per layer at H3 dims, ticket counters back to zero after every launch, and the same bits
over repeated launches and from two streams at once (each stream has its own counters)."""

import pytest
import torch
from timestep_layers import per_layer_forward

from flowlock.ops.timestep import triton as timestep_triton
from flowlock.testing import assert_bitwise_equal

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

K, HIDDEN, EMBED = 256, 5376, 2688


def _params(seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(HIDDEN, K, device="cuda", generator=g) / 16, torch.randn(HIDDEN, device="cuda", generator=g),
            torch.randn(EMBED, HIDDEN, device="cuda", generator=g) / HIDDEN ** 0.5,
            torch.randn(EMBED, device="cuda", generator=g)]


def _zero_counters():
    return torch.equal(timestep_triton._sync_counters(torch.device("cuda", torch.cuda.current_device())).cpu(),
                       torch.zeros(3, dtype=torch.int32))


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_one_launch_forward_equals_one_launch_per_layer(rows):
    params = _params(rows)
    x = torch.randn(rows, K, device="cuda", generator=torch.Generator(device="cuda").manual_seed(rows + 1))
    fused = timestep_triton.timestep_mlp_fwd(x, *params)
    assert_bitwise_equal(fused, per_layer_forward(x, *params), f"T={rows}")
    torch.cuda.synchronize()
    assert _zero_counters()


def test_repeated_launches_and_two_streams_give_the_same_bits():
    params = _params(0)
    x = torch.randn(3, K, device="cuda", generator=torch.Generator(device="cuda").manual_seed(5))
    first = timestep_triton.timestep_mlp_fwd(x, *params)
    results = [timestep_triton.timestep_mlp_fwd(x, *params) for _ in range(20)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    torch.cuda.synchronize()
    for _ in range(10):
        for stream in streams:
            with torch.cuda.stream(stream):
                results.append(timestep_triton.timestep_mlp_fwd(x, *params))
    torch.cuda.synchronize()
    for r in results:
        assert_bitwise_equal(r, first, "repeated / concurrent launch")
    for stream in streams:
        with torch.cuda.stream(stream):
            assert _zero_counters()
    assert _zero_counters()
