"""Helpers shared by tests that run whole clusters and rank processes."""

import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import psutil
import redis

from cli.services import LocalCluster
from jobs.lifecycle import JobState
from jobs.schemas import JobRecord, Placement
from jobs.settings import Settings
from jobs.store import JobStore
from ring_worker.runtime.node_ranks import recorded_rank

WAIT_S = 60
LONG_DOCUMENT = "Ring attention splits a long prompt over several machines. " * 300  # ~3,000 tok


def short_tmp_dir(prefix: str) -> Path:
    """A fresh dir under /tmp: unix socket paths must stay under ~104 bytes (macOS's $TMPDIR
    alone is ~50)."""
    base = "/tmp" if os.path.isdir("/tmp") else None
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base))


@contextmanager
def private_cluster(
    name_prefix: str, env: dict[str, str], node_count: int = 2
) -> Iterator[LocalCluster]:
    """Its own Redis, dispatcher and nodes (two unless asked): the session cluster shares its
    Redis with tests that flush it, and these tests stop its processes."""
    home = short_tmp_dir(f"ringq-{name_prefix}-")
    try:
        settings = Settings(home=home, redis_url=None)
        with LocalCluster(settings, node_count, name_prefix=name_prefix, extra_env=env) as running:
            running.wait_ready()
            yield running
    finally:
        shutil.rmtree(home, ignore_errors=True)


def in_prefill(record: JobRecord) -> JobRecord | None:
    if record.state.is_final:
        raise AssertionError(f"job ended before it could be cancelled: {record}")
    started = record.state == JobState.PREFILL and record.progress.processed > 0
    return record if started else None


def final_record(store: JobStore, job_id: str) -> JobRecord | None:
    record = store.get(job_id)
    return record if record.state.is_final else None


def rank_processes(group_id: str) -> list[int]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if "ring_worker.rank_main" in cmdline and group_id in cmdline:
            found.append(proc.pid)
    return found


@contextmanager
def stopped(pids: list[int]) -> Iterator[None]:
    """SIGSTOP the processes for the block, SIGCONT them after, whatever happens."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


def wait_for(check: Callable[[], object], what: str, timeout_s: float = WAIT_S):
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return value


def child_pid(cluster, label: str) -> int:
    return next(process.pid for name, process, _ in cluster.children if name == label)


def rank_log(cluster, placement: Placement, rank: int) -> str:
    path = cluster.settings.home / "logs" / f"{placement.group_id}-rank{rank}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def find_rank_pid(group_id: str, rank: int) -> int | None:
    """The pid of `rank`'s process in group `group_id`, if it runs."""
    for pid in rank_processes(group_id):
        with suppress(psutil.Error):
            argv = psutil.Process(pid).cmdline()
            if argv[argv.index("--rank") + 1] == str(rank):
                return pid
    return None


def rank_pid(group_id: str, rank: int, conn: redis.Redis | None = None, node: str = "") -> int:
    """As find_rank_pid; given Redis and the rank's node, also a rank that began as its agent's
    spare (started before its group: no group id on its command line), from the agent's record
    (keys.node_ranks)."""
    pid = find_rank_pid(group_id, rank)
    if pid is None and conn is not None:
        record = recorded_rank(conn, node, group_id, rank)
        pid = record.pid if record is not None else None
    if pid is None:
        raise AssertionError(f"no rank {rank} process for group {group_id}")
    return pid


def completions(cluster, job_id: str) -> int:
    """How many groups ran `job_id` to completion (rank 0 logs `done` after writing the result)."""
    done = f"job {job_id} rank 0: done"
    logs = (cluster.settings.home / "logs").glob("*-rank0.log")
    return sum(log.read_text(errors="replace").count(done) for log in logs)


def completions_of_finished(cluster, job_id: str) -> int:
    """completions() of a job already seen finished: rank 0 logs `done` just after it writes the
    result, so wait for the first line rather than read the logs at once."""
    return wait_for(lambda: completions(cluster, job_id), f"rank 0 to log job {job_id} done")


def long_stream(client, model: str):
    """A streamed chat completion that decodes for a long while (OpenAI client): for tests
    that cancel it or close it early."""
    long_document = "Ring attention passes key and value blocks around a ring. " * 150
    return client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": long_document}, {"role": "user", "content": "?"}],
        max_tokens=4000,
        stream=True,
    )
