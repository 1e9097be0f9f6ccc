"""Turn counters: programs of one launch adding into a shared fp32 buffer in a fixed order.

A kernel whose programs each contribute one term to the same output tile (the attention backward's
dQ, one term per KV block) keeps the bits of a single program's ascending loop only if the terms
arrive in ascending order. Float atomics add in arrival order; here each output tile has an int32
turn counter instead, and program ``j`` adds its term only when the counter reads ``j``, then sets
it to ``j + 1``. The buffer's fp32 values pass through memory unchanged, so the chain of additions
is exactly the one a single program would run.

Programs take their index from a launch-wide int32 ticket (:func:`take_ticket`) rather than from
``tl.program_id``: a program is only given ticket ``t`` once the program holding ``t - 1`` has
started, so the program it waits for is always running or done, whatever order the hardware
schedules blocks in, and the launch cannot deadlock. The ticket and the turn counters start at zero
(the launcher allocates them zeroed).

Interpreted (Triton's CPU interpreter runs the programs one after another in ticket order), every
turn has already arrived when it is asked for: :func:`wait_turn` raises if it has not.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


@triton.jit
def take_ticket(counter):
    """This program's index in start order: ``atomic_add(counter, 1)``'s old value (int32 scalar)."""
    return tl.atomic_add(counter, 1, sem="relaxed", scope="gpu")


@triton.jit
def wait_turn(turn, want):
    """Spin until ``*turn == want`` (acquire, GPU scope) and return the value read, ``want``.

    Every thread polls (each then holds its own acquire, so its later loads see what the previous
    holder of the turn stored). The caller should make the address of the buffer it then reads
    depend on the returned value, so no load can be scheduled before the wait."""
    if COMPILED:
        seen = tl.inline_asm_elementwise(
            "{ .reg .pred not_yet; poll: ld.acquire.gpu.global.b32 $0, [$1]; setp.ne.s32 not_yet, $0, $2; "
            "@not_yet bra poll; }",
            "=r,l,r", [turn, want], dtype=tl.int32, is_pure=False, pack=1)
    else:
        seen = tl.load(turn)
        if seen != want:
            raise RuntimeError(f"turn taken out of order: counter {seen}, program {want}")
    return seen


@triton.jit
def pass_turn(turn, next_holder):
    """Hand the turn on: a block-wide barrier (every thread's stores of this turn come before it),
    then one release store of ``next_holder`` at GPU scope."""
    if COMPILED:
        next_holder = tl.inline_asm_elementwise("bar.sync 0; mov.b32 $0, $1;", "=r,r", [next_holder],
                                                dtype=tl.int32, is_pure=False, pack=1)
    tl.atomic_xchg(turn, next_holder, sem="release", scope="gpu")


# The inline-PTX spin when the kernels are compiled; a plain load and an assertion when @triton.jit
# made interpreted functions (TRITON_INTERPRET=1 when Triton decorated this module).
COMPILED = tl.constexpr(not isinstance(take_ticket, InterpretedFunction))
