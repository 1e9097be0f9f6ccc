"""A TCP port for a local process group's rendezvous."""

from __future__ import annotations

import socket


def free_local_port() -> int:
    """A port on 127.0.0.1 that was free a moment ago (the OS's pick), for ``MASTER_PORT`` or a
    ``tcp://`` init method of processes started on this host."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
