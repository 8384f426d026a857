"""Kill real processes of a running cluster (kill -9: a rank, a node agent, the dispatcher; and
stop Redis) and check that every job still ends correctly, exactly once, with nothing left
behind. bench/reliability.py runs the same scenarios many times and reports the counts."""

import os
import signal
import time
from collections.abc import Iterator
from functools import partial

import pytest

from cli.services import LocalCluster
from jobs import keys
from jobs.lifecycle import JobState
from jobs.redis_server import connect, ensure_redis
from jobs.schemas import JobKind, JobRecord, JobSpec
from jobs.store import JobStore
from jobs.submit import enqueue_jobs, new_job_id, submit_job
from tests.helpers import (
    LONG_DOCUMENT,
    child_pid,
    completions_of_finished,
    final_record,
    in_prefill,
    private_cluster,
    rank_pid,
    rank_processes,
    wait_for,
)

REDIS_OUTAGE_S = 3.0
TEARDOWN_LIMIT_S = 30  # the bound: a broken group is gone within this
CRASH_ENV = {
    "RINGQ_PREFIX_CACHE": "off",  # these prompts must be computed, not taken from a cache
    "RINGQ_PREFILL_CHUNK_TOKENS": "64",
    "RINGQ_NODE_HEARTBEAT_S": "0.5",
    "RINGQ_NODE_TTL_S": "3",
    "RINGQ_RESERVATION_LEASE_S": "5",
    "RINGQ_RANK_PORT_BASE": "32300",  # apart from the other clusters' ranks
}


@pytest.fixture(scope="module")
def crash_cluster() -> Iterator[LocalCluster]:
    with private_cluster("crash", CRASH_ENV) as running:
        yield running


@pytest.fixture
def store(crash_cluster) -> JobStore:
    return JobStore(connect(crash_cluster.url))


def long_job(tiny_llama_dir, **fields) -> JobSpec:
    return JobSpec(
        kind=JobKind.PREFILL, document=LONG_DOCUMENT, model=str(tiny_llama_dir), **fields
    )


def finished(store: JobStore, job_id: str, timeout_s: float = 120) -> JobRecord:
    final = wait_for(lambda: final_record(store, job_id), f"job {job_id} to end", timeout_s)
    assert final.state == JobState.FINISHED, final.error
    return final


def assert_group_gone(store: JobStore, record: JobRecord) -> None:
    assert record.placement is not None
    group_id = record.placement.group_id
    wait_for(lambda: not rank_processes(group_id), "the lost group's ranks to exit")

    def released(node: str) -> bool:  # released, or (a dead agent's) lease expired
        return (store.conn.zscore(keys.node_leases(node), group_id) or 0) < time.time()

    for node in record.placement.nodes:
        wait_for(partial(released, node), f"the lost group's memory on {node} to be released")


def test_a_rank_killed_mid_prefill_is_torn_down_and_the_job_retried(
    crash_cluster, store, tiny_llama_dir
):
    record = submit_job(store.conn, long_job(tiny_llama_dir, ranks=2))
    record = wait_for(lambda: in_prefill(store.get(record.id)), "prefill to start")
    group_id = record.placement.group_id
    survivor, victim = rank_pid(group_id, 0), rank_pid(group_id, 1)
    os.kill(survivor, signal.SIGSTOP)  # still mid-prefill when its peer dies
    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    try:
        wait_for(lambda: store.get(record.id).attempt == 1, "the group to be found lost")
    finally:
        os.kill(survivor, signal.SIGCONT)
    assert_group_gone(store, record)
    assert time.monotonic() - killed_at < TEARDOWN_LIMIT_S
    final = finished(store, record.id)
    assert final.attempt == 1 and final.placement.group_id != group_id
    assert "rank 1 on node crash-1 was killed by signal 9" in final.retry_reasons[0]
    assert final.result is not None and final.result.prompt_tokens == final.progress.total
    assert completions_of_finished(crash_cluster, record.id) == 1


def test_a_killed_node_agent_takes_its_ranks_down_and_the_job_moves_to_the_other_node(
    crash_cluster, store, tiny_llama_dir
):
    record = submit_job(store.conn, long_job(tiny_llama_dir))  # auto: ring over both nodes
    record = wait_for(lambda: in_prefill(store.get(record.id)), "prefill to start")
    assert record.placement.nodes == ["crash-0", "crash-1"]
    os.kill(child_pid(crash_cluster, "crash-1"), signal.SIGKILL)
    try:
        assert_group_gone(store, record)  # its rank exits with its agent
        final = finished(store, record.id)
        assert final.attempt == 1 and final.placement.nodes == ["crash-0"]
        assert completions_of_finished(crash_cluster, record.id) == 1
    finally:
        crash_cluster.restart("crash-1")
    wait_for(lambda: any(n.name == "crash-1" for n in store.live_nodes()), "the agent to be back")
    again = finished(store, submit_job(store.conn, long_job(tiny_llama_dir, ranks=2)).id)
    assert sorted(again.placement.nodes) == ["crash-0", "crash-1"] and again.attempt == 0


def short_jobs(tiny_llama_dir, count: int) -> list[tuple[str, JobSpec]]:
    spec = JobSpec(kind=JobKind.PREFILL, document="A short note. " * 20, model=str(tiny_llama_dir))
    return [(new_job_id(), spec) for _ in range(count)]


def test_a_killed_dispatcher_loses_no_job_after_a_restart(crash_cluster, store, tiny_llama_dir):
    jobs = enqueue_jobs(store.conn, short_jobs(tiny_llama_dir, 6))
    wait_for(
        lambda: any(store.get(j.id).state != JobState.QUEUED for j in jobs), "a first admission"
    )
    os.kill(child_pid(crash_cluster, "dispatcher"), signal.SIGKILL)
    crash_cluster.restart("dispatcher")
    # an admission cut short by the kill is retried as soon as the reconciler sees its
    # dispatcher gone (jobs/recovery.py); without that, after its timeout (65 s)
    for job in jobs:
        finished(store, job.id, timeout_s=180)
        assert completions_of_finished(crash_cluster, job.id) == 1


def test_redis_restarted_under_queued_jobs_loses_none(crash_cluster, store, tiny_llama_dir):
    jobs = enqueue_jobs(store.conn, short_jobs(tiny_llama_dir, 12))
    wait_for(
        lambda: any(store.get(j.id).state != JobState.QUEUED for j in jobs), "a first admission"
    )
    assert crash_cluster.redis is not None
    url = crash_cluster.url
    crash_cluster.redis.stop()  # SIGTERM, waited for: the append-only file keeps every write
    # The outage itself is the test, so this sleep stays: long enough for every service to hit
    # it (heartbeats every 0.5 s, agents' monitor passes every 0.2 s, the dispatcher's
    # reconciler every 1 s; the reconciler treats nodes as gone after 2 s), far inside the
    # 60 s the services ride out (SERVICE_RIDE_OUT_S), however slow the machine.
    time.sleep(REDIS_OUTAGE_S)
    crash_cluster.redis = ensure_redis(crash_cluster.settings)
    assert crash_cluster.redis.url == url  # the same socket: services reconnect by themselves
    store = JobStore(connect(url))
    for job in jobs:
        finished(store, job.id, timeout_s=180)
        assert completions_of_finished(crash_cluster, job.id) == 1
    crash_cluster.check_children()  # dispatcher and agents rode it out
