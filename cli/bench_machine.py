"""What `ringq bench` records about the machine it ran on, and the model FLOPs utilisation of a
prefill: the compute peak is measured in the same run (a matmul probe in a fresh process, so the
bench process itself never initialises MLX)."""

import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil

from admission.model_shape import ModelShape
from jobs.settings import Settings
from ring_worker.runtime.processes import find_openblas, rank_environment

BACKEND_PROBE = (
    "import mlx.core as mx; "
    "print('metal' if mx.metal.is_available() else 'cuda' if mx.cuda.is_available() else 'cpu')"
)
# Median of timed square matmuls in the dtype ranks compute in (bf16 on GPUs, float32 on CPUs).
MATMUL_PROBE = """
import json, statistics, sys, time
import mlx.core as mx
gpu = mx.metal.is_available() or mx.cuda.is_available()
n, dtype = (8192, mx.bfloat16) if gpu else (1024, mx.float32)
a = mx.random.normal((n, n)).astype(dtype); b = mx.random.normal((n, n)).astype(dtype)
mx.eval(a, b)
times = []
for _ in range(12):
    start = time.perf_counter(); mx.eval(a @ b); times.append(time.perf_counter() - start)
seconds = statistics.median(times[2:])
print(json.dumps({"n": n, "dtype": str(dtype), "tflops": 2 * n**3 / seconds / 1e12}))
"""


def machine_info(settings: Settings) -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "memory_bytes": psutil.virtual_memory().total,
        "mlx_version": importlib.metadata.version("mlx"),
        "mlx_lm_version": importlib.metadata.version("mlx-lm"),
        "backend": probe_backend(),
        "blas": blas_description(settings.blas),
        "load_avg_start": os.getloadavg(),
        "source": source_revision(),
    }


def source_revision() -> dict[str, Any] | None:
    """The git commit of the code that ran, and whether it had uncommitted changes.
    RINGQ_SOURCE_COMMIT overrides it where the checkout's .git is not the code's (a copied tree,
    as on the device machine)."""
    given = os.environ.get("RINGQ_SOURCE_COMMIT")
    if given:
        return {"commit": given, "dirty": False, "from": "RINGQ_SOURCE_COMMIT"}
    here = Path(__file__).parent
    try:
        commit = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        status = subprocess.run(
            ["git", "-C", str(here), "status", "--porcelain"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if commit.returncode != 0:
        return None
    return {"commit": commit.stdout.strip(), "dirty": bool(status.stdout.strip())}


def probe_backend() -> str:
    """cpu / metal / cuda, asked in a fresh interpreter (this process never initialises MLX)."""
    probe = subprocess.run(
        [sys.executable, "-c", BACKEND_PROBE], capture_output=True, text=True, timeout=60
    )
    return probe.stdout.strip() or f"unknown ({probe.stderr.strip()[-200:]})"


def blas_description(blas: str) -> str:
    openblas = find_openblas() if sys.platform.startswith("linux") else None
    if blas == "off" or openblas is None:
        return "mlx bundled"
    return f"OpenBLAS preloaded ({openblas})"


def probe_matmul_tflops(blas: str) -> dict[str, Any] | None:
    """The measured dense matmul peak of one device, as a rank would see it (same environment)."""
    probe = subprocess.run(
        [sys.executable, "-c", MATMUL_PROBE],
        capture_output=True,
        text=True,
        timeout=300,
        env=rank_environment(blas),
    )
    try:
        return dict(json.loads(probe.stdout.strip().splitlines()[-1]))
    except (json.JSONDecodeError, IndexError):
        return None


def prefill_flops(shape: ModelShape, tokens: int) -> float:
    """2 · non-embedding parameters · L + 2 · layers · q_heads · head_dim · L² (causal attention
    scores and values, each half of an L×L product)."""
    embedding = shape.vocab_size * shape.hidden_size
    dense_parameters = shape.dense_weight_bytes // shape.compute_dtype_bytes
    non_embedding = dense_parameters - embedding
    attention = 2 * shape.layers * shape.q_heads * shape.head_dim * tokens**2
    return 2 * non_embedding * tokens + attention


def mfu(
    shape: ModelShape, tokens: int, prefill_s: float, devices: int, peak_tflops: float
) -> float:
    return prefill_flops(shape, tokens) / (prefill_s * devices * peak_tflops * 1e12)
