"""Starting rank processes: always a fresh interpreter (MLX must never be forked), OpenBLAS
preloaded on CPU-only Linux nodes, a group that dies together, and ranks that die with the
process that started them."""

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

from ring_worker.engine.devices import node_backend, rank_device_environment

log = logging.getLogger(__name__)

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def find_openblas() -> str | None:
    return next((path for path in OPENBLAS_CANDIDATES if Path(path).exists()), None)


def rank_environment(
    blas: str = "auto",
    threads: int | None = None,
    local_rank: int = 0,
    backend: str = "auto",
    home: Path | None = None,
) -> dict[str, str]:
    """Environment for the `local_rank`-th rank process on this machine. CPU: preloading OpenBLAS
    over the reference BLAS MLX's Linux wheel links makes fp32 matmul 25-35x faster (`blas="off"`
    disables it). CUDA: one GPU per rank (ring_worker/engine/devices.py)."""
    env = dict(os.environ)
    backend = node_backend(backend)
    env.update(rank_device_environment(local_rank, backend, home))
    preload = [p for p in env.get("LD_PRELOAD", "").split(":") if p and "openblas" not in p]
    wanted = blas != "off" and sys.platform.startswith("linux")
    openblas = find_openblas() if wanted and backend == "cpu" else None
    env["LD_PRELOAD"] = ":".join([openblas, *preload] if openblas else preload)
    if threads:  # ranks sharing one machine split its cores instead of oversubscribing them
        env["OPENBLAS_NUM_THREADS"] = str(threads)
    return env


def spawn_rank(
    argv: Sequence[str],
    env: dict[str, str],
    log_path: Path | None = None,
    stdin: int | None = None,
) -> subprocess.Popen:
    """Start one rank as `python -m ...` in a fresh process (its own session, so it can be killed
    with its children) that dies with this one. The calling thread must outlive the rank (see
    die_with_parent): a node agent starts its ranks from its main thread (RQ's SimpleWorker runs
    commands there), `ringq run` from the thread that waits for them."""
    if log_path is None:
        return _popen(argv, env, None, stdin)
    with open(log_path, "ab") as out:  # the child keeps its own copy of the descriptor
        return _popen(argv, env, out, stdin)


def _popen(
    argv: Sequence[str], env: dict[str, str], out: IO[bytes] | None, stdin: int | None
) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, *argv],
        env={**env, "RINGQ_PARENT_PID": str(os.getpid())},  # the rank exits with this process
        stdin=stdin,
        stdout=out,
        stderr=None if out is None else subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=die_with_parent(),
    )


def die_with_parent() -> Callable[[], None] | None:
    """On Linux, a preexec_fn that has the kernel SIGKILL the child when the thread that starts
    it dies (with its process, kill -9 included). The rank's own parent watch (exit_with_parent)
    is a Python thread, which cannot run while the rank is blocked in a native call holding the
    GIL, as mx.distributed.init waiting for a missing peer is. Between fork and exec the child
    only calls prctl, looked up here, and compares pids: no import, no logging, no lock of
    another thread's (why preexec_fn is unsafe with threads)."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent_pid, kill = os.getpid(), int(signal.SIGKILL)

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, kill, 0, 0, 0)
        if os.getppid() != parent_pid:  # died before prctl: no signal will come
            os._exit(1)

    return arm


def wait_all(procs: list[subprocess.Popen], timeout_s: float | None = None) -> list[int]:
    """Wait for a group; the first rank that fails takes the others down (they would otherwise
    hang in a collective forever). Returns the exit codes."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return [int(c) for c in codes if c is not None]
        if any(c not in (None, 0) for c in codes) or (deadline and time.monotonic() > deadline):
            terminate_all(procs)
        time.sleep(0.05)


def terminate_all(procs: list[subprocess.Popen], grace_s: float = 3.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    end = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def exit_with_parent(parent_pid: int | None = None, poll_s: float = 1.0) -> None:
    """Exit this process (code 1) soon after its parent (`parent_pid`; default: the current
    parent) dies: a rank whose node agent or `ringq run` was killed must not keep computing or
    hold memory. A thread, so it needs the GIL (die_with_parent covers the native calls)."""
    parent = parent_pid or os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        log.error("parent process %d is gone; exiting", parent)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="ringq-exit-with-parent").start()
