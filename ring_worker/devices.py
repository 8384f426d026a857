"""Which accelerator a node has and how much of it a rank may use, asked without initialising MLX
(node agents and `ringq run` never import it; ranks call `cap_device_memory` first thing).

CUDA: one GPU per rank through CUDA_VISIBLE_DEVICES, NCCL_NVLS_ENABLE=0 always (NVLink multicast
hangs these machines), and an MLX memory limit below the card's free memory (MLX CUDA allocates
managed memory and would otherwise spill into host memory instead of failing)."""

import functools
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Literal, cast

log = logging.getLogger(__name__)

NVIDIA_GPUS_DIR = Path("/proc/driver/nvidia/gpus")
CUDA_MEMORY_FRACTION = 0.92  # of the free memory when the rank starts: CUDA context, NCCL buffers

Backend = Literal["cpu", "metal", "cuda"]


def node_backend() -> Backend:
    """RINGQ_BACKEND when set (cpu / cuda), else metal on macOS, cuda where NVIDIA GPUs are
    visible, cpu elsewhere."""
    forced = os.environ.get("RINGQ_BACKEND")
    if forced in ("cpu", "cuda", "metal"):
        return cast(Backend, forced)
    if sys.platform == "darwin":
        return "metal"
    return "cuda" if visible_gpus() else "cpu"


def visible_gpus() -> list[str]:
    """CUDA device ids this process may use: CUDA_VISIBLE_DEVICES if set, else every NVIDIA GPU."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip() and d.strip() != "-1"]
    return list(installed_gpus())


@functools.cache
def installed_gpus() -> tuple[str, ...]:
    """Every NVIDIA GPU of the machine, probed once per process (node agents ask on every
    heartbeat; a machine's GPUs do not change while it runs)."""
    if NVIDIA_GPUS_DIR.is_dir():
        return tuple(str(i) for i in range(len(list(NVIDIA_GPUS_DIR.iterdir()))))
    try:  # containers often hide /proc/driver/nvidia but ship nvidia-smi
        listing = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    return tuple(str(i) for i, line in enumerate(listing.splitlines()) if line.startswith("GPU "))


def rank_device_environment(local_rank: int) -> dict[str, str]:
    """Environment for the `local_rank`-th rank started on this machine: its own GPU (when the
    machine has CUDA GPUs) and NCCL_NVLS_ENABLE=0."""
    gpus = visible_gpus() if node_backend() == "cuda" else []
    if not gpus:
        return {}
    return {"CUDA_VISIBLE_DEVICES": gpus[local_rank % len(gpus)], "NCCL_NVLS_ENABLE": "0"}


def cuda_memory_bytes() -> tuple[int, int] | None:
    """(free, total) bytes of the first visible GPU, from nvidia-smi; None where it cannot say."""
    gpus = visible_gpus()
    if not gpus:
        return None
    try:
        out = subprocess.run(
            [
                "nvidia-smi",
                f"--id={gpus[0]}",
                "--query-gpu=memory.free,memory.total",
                "--format=csv,noheader,nounits",
            ],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
        free_mib, total_mib = (int(v) for v in out.strip().splitlines()[0].split(","))
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
    return free_mib * 1024**2, total_mib * 1024**2


def cap_device_memory() -> int | None:
    """In a rank process on CUDA: limit MLX below the GPU's free memory. Returns the limit."""
    import mlx.core as mx

    if not mx.cuda.is_available():
        return None
    memory = cuda_memory_bytes()
    if memory is None:
        log.warning("cannot read the GPU's free memory (nvidia-smi); MLX runs without a limit")
        return None
    limit = int(memory[0] * CUDA_MEMORY_FRACTION)
    mx.set_memory_limit(limit)
    log.info("MLX memory limit %.1f GiB (free %.1f GiB)", limit / 1024**3, memory[0] / 1024**3)
    return limit
