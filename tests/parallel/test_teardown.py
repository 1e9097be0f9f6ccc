"""end_process_groups: a rank's cyclic garbage that holds a process group is freed before the
groups are destroyed (not at interpreter shutdown), and no group is left."""

import os
import subprocess
import sys
import textwrap

from flowlock.parallel.ports import free_local_port

_WORKER = textwrap.dedent("""
    import gc
    import weakref
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from flowlock.parallel.teardown import end_process_groups

    gc.disable()  # only end_process_groups may collect
    dist.init_process_group("gloo")

    def run():
        holder = nn.Linear(2, 2)
        holder.mesh = init_device_mesh("cpu", (1,))
        holder.me = holder  # a reference cycle, as modules and their hooks make
        return weakref.ref(holder)

    held = run()
    assert held() is not None, "the cycle should outlive its function without a collection"
    end_process_groups()
    assert held() is None and not dist.is_initialized()
    print("ended")
""")


def test_cyclic_group_holders_are_freed_before_the_groups_end():
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_local_port()), WORLD_SIZE="1", RANK="0")
    proc = subprocess.run([sys.executable, "-c", _WORKER], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "ended" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
