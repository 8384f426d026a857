"""Which accelerator a node has and how much of it a rank may use, asked without initialising MLX
(node agents and `ringq run` never import it; ranks call `cap_device_memory` first thing).

CUDA: one GPU per rank through CUDA_VISIBLE_DEVICES, NCCL_NVLS_ENABLE=0 always (NVLink multicast
hangs these machines), and an MLX memory limit below the card's free memory (MLX CUDA allocates
managed memory and would otherwise spill into host memory instead of failing)."""

import functools
import importlib.metadata
import logging
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from admission.vocabulary import Device

log = logging.getLogger(__name__)

NVIDIA_GPUS_DIR = Path("/proc/driver/nvidia/gpus")
CUDA_MEMORY_FRACTION = 0.92  # of the free memory when the rank starts: CUDA context, NCCL buffers
CPU_LOCAL_NODES = 2  # `ringq up` on a machine without GPUs


def node_backend(forced: str = "auto") -> Device:
    """`forced` (RINGQ_BACKEND) unless "auto"; else metal on macOS, cuda where NVIDIA GPUs are
    visible, cpu elsewhere."""
    if forced in ("cpu", "cuda", "metal"):
        return cast(Device, forced)
    if sys.platform == "darwin":
        return "metal"
    return "cuda" if visible_gpus() else "cpu"


@dataclass(frozen=True)
class LocalNode:
    """One node agent `ringq up` starts: its name and the GPU it is pinned to (None: CPU)."""

    name: str
    gpu: str | None = None
    shares_gpu: bool = False  # another local node is pinned to the same GPU


def local_nodes(gpus: list[str], count: int | None, prefix: str = "node") -> list[LocalNode]:
    """`ringq up`'s layout (pure): one node per GPU by default, each pinned to its own; with
    more nodes than GPUs they take turns (and share, which the caller says); on CPU, `count`
    nodes (default 2)."""
    if not gpus:
        return [
            LocalNode(f"{prefix}-{i}") for i in range(CPU_LOCAL_NODES if count is None else count)
        ]
    count = len(gpus) if count is None else count
    pinned = [gpus[i % len(gpus)] for i in range(count)]
    return [
        LocalNode(f"{prefix}-{i}", gpu, shares_gpu=pinned.count(gpu) > 1)
        for i, gpu in enumerate(pinned)
    ]


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


def rank_device_environment(
    local_rank: int, backend: str = "auto", home: Path | None = None
) -> dict[str, str]:
    """Environment for the `local_rank`-th rank started by this process: a GPU of its own while
    there are enough (a pinned node agent sees one), NCCL_NVLS_ENABLE=0, and nvidia-smi's device
    order, so that CUDA's device i is the one whose memory nvidia-smi reports. With `home`
    (RINGQ_HOME), the kernels MLX compiles (NVRTC) are kept there (`kernel_cache_dir`), unless
    MLX_PTX_CACHE_DIR is set already."""
    gpus = visible_gpus() if node_backend(backend) == "cuda" else []
    if not gpus:
        return {}
    gpu = gpus[local_rank % len(gpus)]
    env = {"CUDA_VISIBLE_DEVICES": gpu, "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "NCCL_NVLS_ENABLE": "0"}
    if home is not None and "MLX_PTX_CACHE_DIR" not in os.environ:
        env["MLX_PTX_CACHE_DIR"] = str(kernel_cache_dir(home, gpu_name(gpu)))
    return env


def kernel_cache_dir(home: Path, gpu: str) -> Path:
    """Where ranks keep MLX's compiled CUDA kernels: under RINGQ_HOME, one folder per MLX version
    and GPU model (MLX names its cached kernels by kernel and shape only), not the temp dir that
    a reboot or a fresh container empties (35 s of compiling in the first jobs)."""
    try:
        mlx_version = importlib.metadata.version("mlx")
    except importlib.metadata.PackageNotFoundError:
        mlx_version = "unknown"
    model = re.sub(r"[^A-Za-z0-9.]+", "-", gpu).strip("-") or "gpu"
    return home / "kernels" / f"mlx-{mlx_version}" / model


@functools.cache
def gpu_name(index: str) -> str:
    """The product name of GPU `index` ("NVIDIA H200"), or "" where nvidia-smi cannot say."""
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--id={index}", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.strip().splitlines()[0] if out.strip() else ""


def cuda_memory_bytes(gpu: str | None = None) -> tuple[int, int] | None:
    """(free, total) bytes of GPU `gpu` (default: the first visible one), from nvidia-smi; None
    where it cannot say."""
    gpus = [gpu] if gpu is not None else visible_gpus()
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


def cap_device_memory(budget_bytes: int | None = None) -> int | None:
    """In a rank process on CUDA: limit MLX below the GPU's free memory, and to the node's
    budget where it has one (ranks sharing a GPU each get their share). Returns the limit."""
    import mlx.core as mx

    if not mx.cuda.is_available():
        return None
    memory = cuda_memory_bytes()
    if memory is None:
        log.warning("cannot read the GPU's free memory (nvidia-smi); MLX runs without a limit")
        return None
    limit = int(memory[0] * CUDA_MEMORY_FRACTION)
    if budget_bytes:
        limit = min(limit, budget_bytes)
    mx.set_memory_limit(limit)
    log.info("MLX memory limit %.1f GiB (free %.1f GiB)", limit / 1024**3, memory[0] / 1024**3)
    return limit
