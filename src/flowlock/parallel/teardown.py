"""Ending a rank's process groups while the interpreter can still free what holds them.

Objects that hold a process group (a device mesh in a model's parallel config, FSDP2 unit state,
DTensors, finished gloo work) often sit in reference cycles through modules and their hooks, so
without a collection they are freed by the final garbage collection of interpreter shutdown. A gloo
group destructed there can abort the process ("terminate called without an active exception"),
seen on ranks whose work had finished and reported: the rank then exits non-zero.
"""

from __future__ import annotations

import gc

import torch.distributed as dist


def end_process_groups() -> None:
    """Collect the garbage that may hold a process group, then destroy every group. Call it once the
    rank's work has returned, with nothing that holds a group still referenced (a worker's model
    lives in a function that has returned, not in a module global)."""
    gc.collect()
    dist.destroy_process_group()
