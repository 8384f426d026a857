"""A node agent killed (kill -9) while its rank joins a two-rank group: the rank must not outlive
it, and an agent started again at once under the same name must have the job retried at once,
not left in loading until rank 0's 600 s loading limit. Real agents, dispatcher, Redis and
ranks; rank 1 is stopped (SIGSTOP) before it joins, so rank 0 waits for it in
mx.distributed.init, which holds the GIL: no Python thread of the rank runs meanwhile."""

import os
import signal
import time
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import dataclass
from functools import partial

import psutil
import pytest

from cli.services import LocalCluster
from jobs.lifecycle import JobState
from jobs.redis_server import connect
from jobs.schemas import JobKind, JobRecord, JobSpec
from jobs.store import JobStore
from jobs.submit import submit_job
from tests.helpers import (
    LONG_DOCUMENT,
    child_pid,
    final_record,
    find_rank_pid,
    private_cluster,
    wait_for,
)

# Heartbeats far apart (a node goes stale after 2 x 8 + 1 = 17 s) so that a restarted agent is
# back long before its node could be found gone that way.
ENV = {
    "RINGQ_PREFIX_CACHE": "off",
    "RINGQ_GROUP_IDLE_S": "0",
    "RINGQ_NODE_HEARTBEAT_S": "8",
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


AGENTS = ("die-0", "die-1")


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


@dataclass(frozen=True)
class Stuck:
    """A two-rank job whose rank 1 was stopped before it joined, and whose rank 0 waits for it
    in mx.distributed.init."""

    job_id: str
    nodes: list[str]  # per rank
    pids: list[int]  # per rank


def stuck_joining(cluster: LocalCluster, store: JobStore, tiny_llama_dir) -> Stuck:
    spec = JobSpec(kind=JobKind.PREFILL, document=LONG_DOCUMENT, model=str(tiny_llama_dir), ranks=2)
    job_id = submit_job(store.conn, spec).id
    placement = wait_for(lambda: store.get(job_id).placement, "the job's placement")
    rank1 = wait_for(partial(find_rank_pid, placement.group_id, 1), "rank 1 to start")
    os.kill(rank1, signal.SIGSTOP)  # long before its imports are done: it never joins
    rank0 = wait_for(partial(find_rank_pid, placement.group_id, 0), "rank 0 to start")
    wait_for(partial(listening, rank0), "rank 0 to wait for its peer")
    assert store.get(job_id).state == JobState.LOADING
    return Stuck(job_id, placement.nodes, [rank0, rank1])


def finished(store: JobStore, job_id: str) -> JobRecord:
    final = wait_for(lambda: final_record(store, job_id), f"job {job_id} to end", 180)
    assert final.state == JobState.FINISHED, final.error
    return final


def test_a_rank_blocked_joining_its_group_exits_with_its_killed_agent(
    death_cluster, store, tiny_llama_dir
):
    stuck = stuck_joining(death_cluster, store, tiny_llama_dir)
    rank0 = stuck.pids[0]
    try:
        os.kill(child_pid(death_cluster, stuck.nodes[0]), signal.SIGKILL)
        killed_at = time.monotonic()
        wait_for(lambda: not alive(rank0), "rank 0 to exit with its agent", 20)
        gone_s = time.monotonic() - killed_at
        assert gone_s < RANK_GONE_LIMIT_S, f"rank 0 outlived its agent by {gone_s:.1f} s"
    finally:
        for pid in stuck.pids:  # the group is lost either way: the job is retried
            with suppress(ProcessLookupError):  # gone already if its group was found lost
                os.kill(pid, signal.SIGKILL)
        death_cluster.restart(stuck.nodes[0])
    final = finished(store, stuck.job_id)
    assert final.attempt >= 1


def test_an_agent_restarted_at_once_has_its_predecessors_job_retried(
    death_cluster, store, tiny_llama_dir
):
    wait_for(lambda: {n.name for n in store.live_nodes()} >= set(AGENTS), "both nodes")
    stuck = stuck_joining(death_cluster, store, tiny_llama_dir)
    job_id, node1 = stuck.job_id, stuck.nodes[1]
    os.kill(child_pid(death_cluster, node1), signal.SIGKILL)
    death_cluster.restart(node1)  # as `ringq up`'s supervisor does, before the heartbeat lapses
    restarted_at = time.monotonic()
    wait_for(lambda: store.get(job_id).attempt == 1, "the job to be retried", RETRY_LIMIT_S + 30)
    retried_s = time.monotonic() - restarted_at
    assert retried_s < RETRY_LIMIT_S, f"retried {retried_s:.0f} s after the agent came back"
    reason = store.get(job_id).retry_reasons[0]
    assert f"rank 1 on node {node1}" in reason and "restarted" in reason, reason
    wait_for(lambda: not any(map(alive, stuck.pids)), "the lost group's ranks to exit")
    final = finished(store, job_id)
    assert final.attempt == 1 and final.placement is not None
