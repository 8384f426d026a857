"""A stalled rank seen by its node agent (ring_worker/runtime/stall.py): first the rule on job
records in
a real Redis with a hand-driven clock, then a real single-rank group whose rank is SIGSTOPped
mid-prefill (its own watchdog stops with it, and it has no peer): the agent's monitor pass
reports the group lost, the job is queued for a retry, and the rank is killed."""

import os
import signal
from collections.abc import Iterator

import pytest

from jobs import keys
from jobs.lifecycle import JobState
from jobs.recovery import track_group
from jobs.schemas import GroupSpec, JobKind, JobRecord, JobSpec, Placement, Progress
from jobs.settings import Settings
from jobs.store import JobStore
from jobs.submit import admit_queue
from ring_worker.runtime.node_agent import NodeAgent
from ring_worker.runtime.stall import WATCHDOG_GRACE_S, StallWatch
from ring_worker.runtime.watchdog import loading_timeout_s
from tests.helpers import in_prefill, wait_for

STALL_TIMEOUT_S = 2.0
LIMIT_S = STALL_TIMEOUT_S + WATCHDOG_GRACE_S  # the rank's own watchdog has the first word


@pytest.fixture
def settings(short_tmp_path) -> Settings:
    return Settings(home=short_tmp_path, redis_url=None, stall_timeout_s=STALL_TIMEOUT_S)


@pytest.fixture
def store(redis_conn) -> JobStore:
    return JobStore(redis_conn)


class Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def placement_on(group_id: str, chunk_tokens: int = 64) -> str:
    placement = Placement(
        strategy="single",
        ranks=1,
        nodes=["n0"],
        group_id=group_id,
        bytes_per_node=1,
        chunk_tokens=chunk_tokens,
    )
    return placement.model_dump_json()


def placed_job(store: JobStore, group: GroupSpec, chunk_tokens: int = 64) -> None:
    """What the dispatcher does at admission, minus starting the ranks."""
    store.create(group.job_id, JobSpec(kind=JobKind.PREFILL, document="x", model=group.model))
    store.transition(group.job_id, JobState.ADMITTED)
    placement = placement_on(group.group_id, chunk_tokens)
    store.conn.hset(keys.job(group.job_id), "placement", placement)
    track_group(store.conn, group)


def group_of(job_id: str, group_id: str, model: str = "random:tiny-llama") -> GroupSpec:
    return GroupSpec(
        group_id=group_id,
        job_id=job_id,
        model=model,
        nodes=["n0"],
        addresses=["127.0.0.1:0"],
        strategy="single",
    )


def test_a_started_job_without_reports_for_the_timeout_is_stalled(store, settings):
    clock = Clock()
    watch = StallWatch(store, settings, "n0", clock)
    group = group_of("j1", "g1")
    placed_job(store, group)
    clock.now_s += 10 * STALL_TIMEOUT_S
    assert watch.check(group) is None  # admitted: the rank has not started the job
    store.transition("j1", JobState.LOADING)  # the rank reports loading: the clock starts
    assert watch.check(group) is None
    clock.now_s += LIMIT_S + 1
    assert watch.check(group) is None  # loading has the rank watchdog's longer limit
    clock.now_s += loading_timeout_s(STALL_TIMEOUT_S)
    assert "no progress" in (watch.check(group) or "")
    store.transition("j1", JobState.PREFILL, progress=Progress(phase="prefill", total=9))
    for processed in range(1, 4):  # progress reports keep it alive, however long it all takes
        clock.now_s += LIMIT_S - 0.1
        assert watch.check(group) is None
        store.set_progress("j1", Progress(phase="prefill", processed=processed, total=9))
        assert watch.check(group) is None
    clock.now_s += LIMIT_S - 0.1
    assert watch.check(group) is None
    clock.now_s += 0.2
    reason = watch.check(group)
    assert reason is not None and f"limit {STALL_TIMEOUT_S:g} s" in reason and "prefill" in reason


def test_jobs_that_ended_or_moved_on_are_not_watched(store, settings):
    clock = Clock()
    watch = StallWatch(store, settings, "n0", clock)
    group = group_of("j1", "g1")
    placed_job(store, group)
    store.transition("j1", JobState.LOADING)
    store.transition("j1", JobState.PREFILL)
    assert watch.check(group) is None
    store.conn.hset(keys.job("j1"), "placement", placement_on("g2"))  # a retry's group
    clock.now_s += 10 * STALL_TIMEOUT_S
    assert watch.check(group) is None
    store.conn.hset(keys.job("j1"), "placement", placement_on("g1"))
    assert watch.check(group) is None  # seen again: its clock starts afresh
    store.transition("j1", JobState.FINISHED)  # a warm group waits idle for its next job
    clock.now_s += 10 * STALL_TIMEOUT_S
    assert watch.check(group) is None
    store.conn.delete(keys.job("j1"))
    assert watch.check(group) is None


@pytest.fixture
def agent(redis_conn, redis_url, settings) -> Iterator[NodeAgent]:
    agent = NodeAgent("n0", redis_conn, redis_url, settings)
    yield agent
    for rp in agent.ranks:
        rp.process.kill()
        rp.process.wait(timeout=30)


def test_the_agent_loses_a_stopped_single_rank_group_and_the_job_is_retried(
    agent, store, tiny_llama_dir
):
    group = group_of("j1", "g1", model=str(tiny_llama_dir))
    placed_job(store, group, chunk_tokens=16)
    store.set_tokens("j1", [10 + i % 900 for i in range(6000)])  # 375 chunks of 16
    assert agent.start_rank(group, 0)
    [rank] = agent.ranks
    wait_for(lambda: in_prefill(store.get("j1")), "the rank to be mid-prefill")
    os.kill(rank.process.pid, signal.SIGSTOP)
    try:
        record = wait_for(
            lambda: retried_after_a_pass(agent, store, "j1"),
            "the agent to find the rank stalled",
            timeout_s=30 + LIMIT_S,
        )
    finally:
        if rank.process.poll() is None:  # still ours (not reaped): never signal a reused pid
            os.kill(rank.process.pid, signal.SIGCONT)
    assert record.state == JobState.QUEUED and record.placement is None
    [reason] = record.retry_reasons
    assert reason.startswith("rank 0 on node n0 reported no progress for") and "prefill" in reason
    assert admit_queue(store.conn).job_ids == ["admit-j1-attempt1"]
    assert rank.process.wait(timeout=30) == -signal.SIGKILL
    agent.reap_ranks()  # its exit: already handled, nothing more happens to the job
    assert agent.ranks == [] and store.get("j1").attempt == 1


def retried_after_a_pass(agent: NodeAgent, store: JobStore, job_id: str) -> JobRecord | None:
    """One pass of the agent's monitor loop; the job once it has been sent for a retry."""
    agent.reap_ranks()
    record = store.get(job_id)
    return record if record.attempt == 1 else None
