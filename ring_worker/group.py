"""Joining an mx.distributed ring group from a list of rank addresses."""

import json
import os
import socket
from pathlib import Path
from typing import Any

import mlx.core as mx


def join_group(addresses: list[str], rank: int, scratch_dir: Path) -> Any:
    """Join the ring of `addresses` ("host:port", one per rank) as `rank`; None when alone."""
    if len(addresses) == 1:
        return None
    hostfile = scratch_dir / f"hostfile-rank{rank}.json"
    hostfile.write_text(json.dumps([[address] for address in addresses]))
    os.environ["MLX_HOSTFILE"] = str(hostfile)
    os.environ["MLX_RANK"] = str(rank)
    group = mx.distributed.init(strict=True, backend="ring")
    if group.size() != len(addresses) or group.rank() != rank:
        raise RuntimeError(
            f"joined as {group.rank()}/{group.size()}, expected {rank}/{len(addresses)}"
        )
    return group


def free_loopback_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Ports the OS says are free right now (for local groups: `ringq run`, tests)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind((host, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()
