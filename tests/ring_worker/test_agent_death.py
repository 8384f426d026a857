"""A node agent killed (kill -9) while its rank joins a two-rank group: the rank must not outlive
it. Real agents, dispatcher, Redis and ranks; rank 1 is stopped (SIGSTOP) before it joins, so
rank 0 waits for it in mx.distributed.init, which holds the GIL: no Python thread of the rank
runs meanwhile."""

import os
import signal
import time
from collections.abc import Iterator
from contextlib import suppress
from functools import partial

import psutil
import pytest

from cli.services import LocalCluster
from jobs.lifecycle import JobState
from jobs.redis_server import connect
from jobs.schemas import JobKind, JobRecord, JobSpec
from jobs.store import JobStore
from jobs.submit import submit_job
from tests.helpers import LONG_DOCUMENT, child_pid, final_record, private_cluster, wait_for

# Heartbeats far apart (a node goes stale after 2 x 5 + 1 = 11 s) so that a restarted agent is
# back long before its node could be found gone that way.
ENV = {
    "RINGQ_PREFIX_CACHE": "off",
    "RINGQ_GROUP_IDLE_S": "0",
    "RINGQ_NODE_HEARTBEAT_S": "5",
    "RINGQ_NODE_TTL_S": "30",
    "RINGQ_RESERVATION_LEASE_S": "5",
    "RINGQ_RANK_PORT_BASE": "41700",  # apart from the other clusters' ranks
}
RANK_GONE_LIMIT_S = 5.0
RETRY_LIMIT_S = 30.0  # the bug: ~600 s (the loading limit of rank 0's watchdog)


@pytest.fixture(scope="module")
def death_cluster() -> Iterator[LocalCluster]:
    with private_cluster("die", ENV) as running:
        yield running


@pytest.fixture
def store(death_cluster) -> JobStore:
    return JobStore(connect(death_cluster.url))


def rank_child(agent_pid: int) -> int | None:
    """The pid of the rank process `agent_pid` started, if any."""
    for child in psutil.Process(agent_pid).children():
        try:
            if "ring_worker.rank_main" in " ".join(child.cmdline()):
                return child.pid
        except psutil.Error:
            continue
    return None


def listening(pid: int) -> bool:
    """Rank 0 of MLX's ring listens for its peer inside mx.distributed.init."""
    try:
        return any(c.status == psutil.CONN_LISTEN for c in psutil.Process(pid).net_connections())
    except psutil.Error:
        return False


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def stuck_joining(cluster: LocalCluster, store: JobStore, tiny_llama_dir) -> tuple[str, int, int]:
    """A two-rank job whose rank 1 is stopped before it joins and whose rank 0 waits for it
    in mx.distributed.init: (job id, rank 0's pid, rank 1's pid)."""
    spec = JobSpec(kind=JobKind.PREFILL, document=LONG_DOCUMENT, model=str(tiny_llama_dir), ranks=2)
    job_id = submit_job(store.conn, spec).id
    rank1 = wait_for(partial(rank_child, child_pid(cluster, "die-1")), "rank 1 to start")
    os.kill(rank1, signal.SIGSTOP)  # long before its imports are done: it never joins
    rank0 = wait_for(partial(rank_child, child_pid(cluster, "die-0")), "rank 0 to start")
    wait_for(partial(listening, rank0), "rank 0 to wait for its peer")
    record = store.get(job_id)
    assert record.state == JobState.LOADING and record.placement is not None
    assert record.placement.nodes == ["die-0", "die-1"]
    return job_id, rank0, rank1


def finished(store: JobStore, job_id: str) -> JobRecord:
    final = wait_for(lambda: final_record(store, job_id), f"job {job_id} to end", 180)
    assert final.state == JobState.FINISHED, final.error
    return final


def test_a_rank_blocked_joining_its_group_exits_with_its_killed_agent(
    death_cluster, store, tiny_llama_dir
):
    job_id, rank0, rank1 = stuck_joining(death_cluster, store, tiny_llama_dir)
    try:
        os.kill(child_pid(death_cluster, "die-0"), signal.SIGKILL)
        killed_at = time.monotonic()
        wait_for(lambda: not alive(rank0), "rank 0 to exit with its agent", 20)
        gone_s = time.monotonic() - killed_at
        assert gone_s < RANK_GONE_LIMIT_S, f"rank 0 outlived its agent by {gone_s:.1f} s"
    finally:
        for pid in (rank0, rank1):  # the group is lost either way: the job is retried
            with suppress(ProcessLookupError):  # gone already if its group was found lost
                os.kill(pid, signal.SIGKILL)
        death_cluster.restart("die-0")
    final = finished(store, job_id)
    assert final.attempt >= 1
