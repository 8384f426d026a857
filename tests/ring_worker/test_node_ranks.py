"""The ranks a node agent records (ring_worker/runtime/node_ranks.py), against a real Redis and real
processes: the node's next agent reports its predecessor's ranks lost, only those and once, and
kills one that still runs, never a process that merely has its pid. The kill -9 of a real agent
is in test_agent_death.py."""

import subprocess
import sys

import pytest

from jobs import keys
from jobs.lifecycle import JobState
from jobs.recovery import track_group
from jobs.reservations import Reservations
from jobs.schemas import GroupSpec, JobKind, JobSpec, NodeRank, Placement, Progress
from jobs.settings import Settings
from jobs.store import JobStore
from ring_worker.runtime.node_ranks import (
    kill_leftover,
    lose_predecessor_ranks,
    process_started_at,
    record_rank,
)


@pytest.fixture
def settings(short_tmp_path) -> Settings:
    return Settings(home=short_tmp_path, redis_url=None, max_retries=2)


@pytest.fixture
def store(redis_conn) -> JobStore:
    return JobStore(redis_conn)


def running_group(store: JobStore, job_id: str, group_id: str) -> GroupSpec:
    """A job placed on a group of n0 and n1, as the dispatcher leaves it, minus the ranks."""
    store.create(job_id, JobSpec(kind=JobKind.PREFILL, document="x", model="random:tiny-llama"))
    nodes = ["n0", "n1"]
    placement = Placement(
        strategy="ring", ranks=2, nodes=nodes, group_id=group_id, bytes_per_node=1
    )
    store.transition(
        job_id,
        JobState.ADMITTED,
        placement=placement,
        progress=Progress(phase=JobState.ADMITTED, total=10),
    )
    group = GroupSpec(
        group_id=group_id,
        job_id=job_id,
        model="random:tiny-llama",
        nodes=nodes,
        addresses=["127.0.0.1:30000", "127.0.0.1:30001"],
    )
    track_group(store.conn, group)
    return group


def node_rank(group: GroupSpec, incarnation: str, pid: int = 0, started_at: float = 0.0):
    return NodeRank(group=group, rank=1, incarnation=incarnation, pid=pid, started_at=started_at)


def test_a_new_agent_reports_only_its_predecessors_ranks_lost(store, settings):
    old = running_group(store, "j-old", "g-old")
    own = running_group(store, "j-own", "g-own")
    reservations = Reservations(store.conn, lease_s=30)
    assert reservations.reserve("g-old", {"n1": (1, 10)}) is None
    record_rank(store.conn, "n1", node_rank(old, "agent-a"))
    record_rank(store.conn, "n1", node_rank(own, "agent-b"))
    lost = lose_predecessor_ranks(store.conn, settings, "n1", "agent-b", reservations)
    assert [rank.group.group_id for rank in lost] == ["g-old"]
    retried = store.get("j-old")
    assert retried.state == JobState.QUEUED and retried.attempt == 1
    assert retried.retry_reasons == [
        "rank 1 on node n1 was lost: its node agent was restarted (the rank was started by "
        "the previous one)"
    ]
    assert store.conn.exists(keys.group_failed("g-old"))  # n0's agent stops its rank
    assert reservations.held("n1") == {}  # its memory on this node is free at once
    assert store.get("j-own").attempt == 0
    assert store.conn.hkeys(keys.node_ranks("n1")) == [b"g-own:1"]
    assert lose_predecessor_ranks(store.conn, settings, "n1", "agent-b", reservations) == []


@pytest.mark.parametrize(
    ("started_at_offset_s", "killed"),
    [(0.0, True), (1.0, False)],  # the same process; another that has its pid
)
def test_a_leftover_rank_is_killed_only_if_it_is_the_same_process(
    store, started_at_offset_s, killed
):
    group = running_group(store, "j1", "g1")
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started_at = process_started_at(process.pid) + started_at_offset_s
        kill_leftover(node_rank(group, "agent-a", process.pid, started_at))
        if killed:
            assert process.wait(timeout=10) == -9
        else:
            with pytest.raises(subprocess.TimeoutExpired):
                process.wait(timeout=0.5)
    finally:
        process.kill()
        process.wait()
