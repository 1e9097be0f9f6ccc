"""Panel stream-K for ``linear``'s forward at small M, in Gluon: frozen in the sm90 bf16 / fp16 forward.

``STREAM_PANELS=1`` in the frozen config turns it on where the walk's last round is mostly idle and
sharing saves it: one row group of tiles holding more than one round of the groups' programs and at
most 1.5 rounds (out and fc2 at M = 925: 168 tiles), decided from tile counts; everywhere else the
forward walks. Measured on the H200 at M = 925 (same bits as the walk; queued / with host time):
out 0.895 / 1.042, fc2 0.825 / 0.907 of the walk (``linear_gluon_stream_h200_73c17e3.json``); q's 224
tiles (1.75 rounds) ran 1.025 of the walk and stay on it. Relaunches are prepared (as the walk's); the
fp32 workspace and the zeroed flags are still made per call, one fill launch more than the walk.

At M <= BLOCK_I * GROUP_I (one group of row tiles: M = 925 is 8 row tiles) the forward's tiles are
``n_j`` column panels of ``n_i`` row tiles, and a walk of whole tiles leaves SMs idle for most of its
last round: q / k / v at M = 925 are 224 tiles on 132 SMs (2 rounds for 1.7 rounds of work), out and
fc2 168 (a split tail: about 1.55). Here ``SMs // n_i`` groups of ``n_i`` programs share the
``n_j * n_k`` panel steps (BLOCK_R steps of a whole panel) out evenly: group g takes one contiguous
range, and its program r computes row tile r of every panel step in it, so the ``n_i`` programs of a
group read each weight block together, as the walk's grouped order has them do (the Triton kernel's
stream-K, whose programs cut tiles at different steps, streamed the weight from DRAM several times
and ran 224 tiles 1.15x slower than the walk).

Bits: a panel cut between groups g - 1 and g stays one accumulation chain per element. Group g - 1's
program r runs the panel's first steps from zero (its *head*) before anything else and publishes the
fp32 accumulator; group g's program r continues the chain from exactly those values (its *tail*)
after its whole panels, then adds the bias, rounds and stores. The values pass through memory
unchanged, so every element is the walk's chain of k16 wgmma steps whatever the cut. Programs take
(g, r) from a ticket, so a tail only ever waits for a head whose program started earlier and ran it
first: no deadlock whatever the block scheduler does.

Warps as :mod:`flowlock.ops.linear.gluon`: one TMA producer warp, two wgmma warpgroups; the producer
loads the head's, the whole panels' and the tail's steps in the consumers' order.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from flowlock.config import LaunchConfig
from flowlock.ops._launch import DescriptorLaunch, PlanTable, fast_launch, launch_hooked
from flowlock.ops.linear.gluon import (
    LOADER_REGS,
    LOADER_WARPS,
    _store_tile,
    asks,
    check_fits,
    descriptors,
    ring_barriers,
)

# Prepared launches, as the walk's (flowlock.ops.linear.gluon): one per layer shape and token count in use.
_PLANS = PlanTable(64)


@gluon.jit
def _share(ticket, n_i, n_j, n_k, groups):
    """``(g, r, first, first_step, last, last_steps)``: this program's group and row tile, the panel its
    range starts in and the step there, the panel it ends in and how many of its steps are in range."""
    g = ticket // n_i
    r = ticket % n_i
    total = n_j * n_k
    start = (g * total) // groups
    end = ((g + 1) * total) // groups
    first = start // n_k
    last = (end - 1) // n_k
    return g, r, first, start - first * n_k, last, end - last * n_k


@gluon.jit
def _load_steps(a_desc, b_desc, a_bufs, b_bufs, ready, empty, oi, oj, k_lo, k_hi, count,
                BLOCK_R: gl.constexpr, RING: gl.constexpr):
    """Issue steps [k_lo, k_hi) of one tile's A and B loads into the ring; returns the ring count."""
    nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    for k in range(k_lo, k_hi):
        s = count % RING
        mbarrier.wait(empty.index(s), ((count // RING) & 1) ^ 1)
        mbarrier.expect(ready.index(s), nbytes)
        tma.async_copy_global_to_shared(a_desc, [oi, k * BLOCK_R], ready.index(s), a_bufs.index(s))
        tma.async_copy_global_to_shared(b_desc, [oj, k * BLOCK_R], ready.index(s), b_bufs.index(s))
        count += 1
    return count


@gluon.jit
def _stream_loader(a_desc, b_desc, a_bufs, b_bufs, ready, empty, ticket, I, J, R, groups, BLOCK_I: gl.constexpr,
                   BLOCK_J: gl.constexpr, BLOCK_R: gl.constexpr, RING: gl.constexpr):
    n_i = gl.cdiv(I, BLOCK_I)
    n_k = gl.cdiv(R, BLOCK_R)
    g, r, first, first_step, last, last_steps = _share(ticket, n_i, gl.cdiv(J, BLOCK_J), n_k, groups)
    oi = r * BLOCK_I
    count = 0
    if last_steps < n_k:
        count = _load_steps(a_desc, b_desc, a_bufs, b_bufs, ready, empty, oi, last * BLOCK_J, 0, last_steps, count,
                            BLOCK_R, RING)
    whole_hi = gl.where(last_steps < n_k, last, last + 1)
    for p in range(first + (first_step > 0).to(gl.int32), whole_hi):
        count = _load_steps(a_desc, b_desc, a_bufs, b_bufs, ready, empty, oi, p * BLOCK_J, 0, n_k, count,
                            BLOCK_R, RING)
    if first_step > 0:
        count = _load_steps(a_desc, b_desc, a_bufs, b_bufs, ready, empty, oi, first * BLOCK_J, first_step, n_k,
                            count, BLOCK_R, RING)


@gluon.jit
def _mma_steps(a_bufs, b_bufs, ready, empty, acc, k_lo, k_hi, count, fresh, RING: gl.constexpr):
    """Steps [k_lo, k_hi) of one tile's wgmma chain onto ``acc`` (from zero at k_lo when ``fresh``);
    returns ``(acc, count)``, every stage it read released."""
    for k in range(k_lo, k_hi):
        s = count % RING
        mbarrier.wait(ready.index(s), (count // RING) & 1)
        acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc,
                            use_acc=(k > k_lo) | (not fresh), is_async=True)
        acc = warpgroup_mma_wait(1, deps=(acc,))
        mbarrier.arrive(empty.index((count + RING - 1) % RING), pred=k > k_lo)
        count += 1
    acc = warpgroup_mma_wait(0, deps=(acc,))
    mbarrier.arrive(empty.index((count + RING - 1) % RING))
    return acc, count


@gluon.jit
def _slot_offsets(layout: gl.constexpr, BLOCK_I: gl.constexpr, BLOCK_J: gl.constexpr):
    rows = gl.arange(0, BLOCK_I, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, BLOCK_J, layout=gl.SliceLayout(0, layout))
    return gl.expand_dims(rows, 1) * BLOCK_J + gl.expand_dims(cols, 0)


@gluon.jit
def _stream_consumer(c_desc, bias_ptr, chain_ptr, flags, a_bufs, b_bufs, c_smem, ready, empty, ticket, I, J, R,
                     groups, HAS_BIAS: gl.constexpr, BLOCK_I: gl.constexpr, BLOCK_J: gl.constexpr,
                     BLOCK_R: gl.constexpr, RING: gl.constexpr, num_warps: gl.constexpr):
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                     instr_shape=[16, BLOCK_J, 16])
    n_i = gl.cdiv(I, BLOCK_I)
    n_k = gl.cdiv(R, BLOCK_R)
    g, r, first, first_step, last, last_steps = _share(ticket, n_i, gl.cdiv(J, BLOCK_J), n_k, groups)
    oi = r * BLOCK_I
    offs = _slot_offsets(layout, BLOCK_I, BLOCK_J)
    count = 0
    zero = gl.zeros((BLOCK_I, BLOCK_J), dtype=gl.float32, layout=layout)
    if last_steps < n_k:
        head, count = _mma_steps(a_bufs, b_bufs, ready, empty, zero, 0, last_steps, count, True, RING)
        gl.store(chain_ptr + ticket.to(gl.int64) * (BLOCK_I * BLOCK_J) + offs, head)
        gl.thread_barrier()  # every consumer thread's part of the head is stored before the release
        gl.atomic_xchg(flags + 1 + ticket, 1, sem="release", scope="gpu")
    whole_hi = gl.where(last_steps < n_k, last, last + 1)
    for p in range(first + (first_step > 0).to(gl.int32), whole_hi):
        acc, count = _mma_steps(a_bufs, b_bufs, ready, empty, zero, 0, n_k, count, True, RING)
        _store_tile(acc, c_desc, c_smem, bias_ptr, oi, p * BLOCK_J, J, HAS_BIAS, BLOCK_J)
    if first_step > 0:
        # The head of this panel is program (g - 1, r)'s: wait for its release. The slot's address
        # depends on the value the wait returns (1), so the loads cannot be issued before it.
        seen = gl.atomic_add(flags + 1 + ticket - n_i, 0, sem="acquire", scope="gpu")
        while seen == 0:
            seen = gl.atomic_add(flags + 1 + ticket - n_i, 0, sem="acquire", scope="gpu")
        slot = ticket - n_i - 1 + seen
        acc = gl.load(chain_ptr + slot.to(gl.int64) * (BLOCK_I * BLOCK_J) + offs, cache_modifier=".cg")
        acc, count = _mma_steps(a_bufs, b_bufs, ready, empty, acc, first_step, n_k, count, False, RING)
        _store_tile(acc, c_desc, c_smem, bias_ptr, oi, first * BLOCK_J, J, HAS_BIAS, BLOCK_J)
    tma.store_wait(pendings=0)


@fast_launch
@gluon.jit
def _linear_fwd_stream_kernel(a_desc, b_desc, c_desc, bias_ptr, chain_ptr, flags, I, J, R, groups,
                              HAS_BIAS: gl.constexpr, BLOCK_I: gl.constexpr, BLOCK_J: gl.constexpr,
                              BLOCK_R: gl.constexpr, RING: gl.constexpr, LOADER_WARPS: gl.constexpr,
                              LOADER_REGS: gl.constexpr, num_warps: gl.constexpr):
    """``C (I, J) = A (I, R) @ B (J, R)^T (+ bias)`` on ``groups * n_i`` programs; ``flags[0]`` is the
    ticket, ``flags[1 + t]`` says program t's head is in slot t of the fp32 ``chain_ptr``
    (programs, BLOCK_I, BLOCK_J); all flags zero at launch."""
    dtype: gl.constexpr = a_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [RING, BLOCK_I, BLOCK_R], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [RING, BLOCK_J, BLOCK_R], b_desc.layout)
    c_smem = gl.allocate_shared_memory(dtype, [BLOCK_I, BLOCK_J], c_desc.layout)
    ready, empty = ring_barriers(RING)
    ticket = gl.atomic_add(flags, 1, sem="relaxed", scope="gpu")
    gl.warp_specialize([
        (_stream_consumer, (c_desc, bias_ptr, chain_ptr, flags, a_bufs, b_bufs, c_smem, ready, empty, ticket, I, J,
                            R, groups, HAS_BIAS, BLOCK_I, BLOCK_J, BLOCK_R, RING, num_warps)),
        (_stream_loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, ticket, I, J, R, groups, BLOCK_I, BLOCK_J,
                          BLOCK_R, RING)),
    ], [LOADER_WARPS], [LOADER_REGS])


def groups(rows: int, cols: int, cfg: LaunchConfig, processors: int) -> int:
    """How many groups a forward of ``rows x cols`` outputs shares its panels among, or 0 where the walk
    runs instead: more than one group of row tiles, fewer panels than groups, or tiles that are not
    more than one round of the groups' programs and at most one and a half (out / fc2 at M = 925,
    0.895 / 0.834 of the walk; q's 1.75 rounds ran 1.025, the hand-offs costing what the shorter round
    saved). Decided from tile counts, like the walk's grid; the bits are the walk's either way."""
    n_i = -(-rows // cfg["BLOCK_I"])
    n_j = -(-cols // cfg["BLOCK_J"])
    count = processors // n_i
    if n_i > cfg["GROUP_I"] or not count < n_j or 2 * n_j > 3 * count:
        return 0
    return count


def applies(cfg: LaunchConfig, a: torch.Tensor, a_t: bool, b: torch.Tensor, b_t: bool, c: torch.Tensor,
            processors: int) -> bool:
    """Whether ``cfg`` runs this product as panel stream-K: it asks for it (``GLUON`` and ``STREAM_PANELS``),
    the product is a forward (the weight stored transposed) on a CUDA device in one 16-bit float dtype,
    and :func:`groups` finds a share."""
    return (asks(cfg, "GLUON", "STREAM_PANELS") and c.is_cuda and not a_t and b_t and cfg["UNIT"] == 0
            and a.dtype in (torch.bfloat16, torch.float16) and a.dtype == b.dtype == c.dtype
            and groups(c.shape[0], c.shape[1], cfg, processors) > 0)


def forward(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, bias: torch.Tensor | None, cfg: LaunchConfig,
            processors: int) -> torch.Tensor:
    """``c = a @ b.T (+ bias)`` as panel stream-K; :func:`applies` holds and the operands are TMA-ready.
    The workspace (one fp32 tile per program) and the ticket and flags are fresh per launch from the
    current stream's allocator, so launches on other streams or replayed in CUDA graphs share none.

    The first launch of each (config, dtype, shapes and strides, bias, device) goes through Gluon and
    keeps its prepared launch; later ones relaunch it with the new tensors, as
    :func:`flowlock.ops.linear.gluon.gemm` does (the key fixes every value the kernel is specialized
    on; the group count and grid follow from the config, C's shape and the device)."""
    check_fits(cfg, a.element_size())
    count = groups(c.shape[0], c.shape[1], cfg, processors)
    programs = count * (-(-c.shape[0] // cfg["BLOCK_I"]))
    chain = torch.empty((programs, cfg["BLOCK_I"], cfg["BLOCK_J"]), dtype=torch.float32, device=c.device)
    flags = torch.zeros(1 + programs, dtype=torch.int32, device=c.device)
    bias_arg = bias if bias is not None else c
    key = (cfg, bias is None, a.dtype, bias_arg.dtype, bias_arg.data_ptr() % 16 == 0, a.shape, a.stride(), b.shape,
           b.stride(), c.shape, c.stride(), torch._C._cuda_getDevice())
    plan = _PLANS.get(key)
    if plan is not None and not launch_hooked():
        plan(programs, torch._C._cuda_getCurrentRawStream(key[-1]), a, b, c, bias_arg, chain, flags, c.shape[0],
             c.shape[1], a.shape[1], count)
        return c
    a_desc, b_desc, c_desc = descriptors(a, b, True, c, cfg)[:3]
    args = (a_desc, b_desc, c_desc, bias_arg, chain, flags, c.shape[0], c.shape[1], a.shape[1], count)
    kwargs = dict(HAS_BIAS=bias is not None, BLOCK_I=cfg["BLOCK_I"], BLOCK_J=cfg["BLOCK_J"], BLOCK_R=cfg["BLOCK_R"],
                  RING=cfg["RING"], LOADER_WARPS=LOADER_WARPS, LOADER_REGS=LOADER_REGS, num_warps=cfg.num_warps)
    _linear_fwd_stream_kernel[(programs,)](*args, **kwargs)
    prepared = _linear_fwd_stream_kernel.prepared(*args, **kwargs)
    if isinstance(prepared, DescriptorLaunch):
        _PLANS.keep(key, prepared)
    return c


def prepared_launches() -> int:
    """How many prepared launches are kept (a GPU test checks relaunches take them)."""
    return len(_PLANS)
