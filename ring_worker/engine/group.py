"""Joining an mx.distributed group from a list of rank addresses: MLX's ring backend (TCP, any
device, send/recv between neighbours) or NCCL (CUDA; collectives only, no send/recv)."""

import json
import os
import socket
from pathlib import Path
from typing import Any

from admission.vocabulary import Transport


def join_group(
    addresses: list[str], rank: int, scratch_dir: Path, backend: Transport = "ring"
) -> Any:
    """Join the group of `addresses` ("host:port", one per rank) as `rank`; None when alone.
    NCCL bootstraps from rank 0's address."""
    import mlx.core as mx  # here: `ringq run` and bench import this module and never init MLX

    if len(addresses) == 1:
        return None
    os.environ["MLX_RANK"] = str(rank)
    if backend == "nccl":
        host, _, port = addresses[0].rpartition(":")
        os.environ.update(
            {"MLX_WORLD_SIZE": str(len(addresses)), "NCCL_HOST_IP": host, "NCCL_PORT": port}
        )
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    else:
        hostfile = scratch_dir / f"hostfile-rank{rank}.json"
        hostfile.write_text(json.dumps([[address] for address in addresses]))
        os.environ["MLX_HOSTFILE"] = str(hostfile)
    group = mx.distributed.init(strict=True, backend=backend)
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
