"""Lost groups against a real Redis: retries, their bound, fencing of stale ranks, and the
reconciler's checks (dead nodes, unrenewed leases). The kills of real processes that lead here
are in test_crash_recovery.py."""

import json
import os
import time

import pytest

from cli.render import describe, status_json
from jobs import keys
from jobs.admit_plan import Cluster, Job, Place, plan_admission
from jobs.checkpoint_marks import CheckpointMark, checkpoint_hint, mark_checkpoint, read_marks
from jobs.errors import StaleGroupError
from jobs.lifecycle import JobState
from jobs.recovery import (
    current_job,
    forget_group,
    lose_group,
    reconcile,
    report_group_failure,
    rescue_dequeued,
    retry_delay_s,
    retry_waits,
    track_group,
)
from jobs.reservations import Reservations
from jobs.schemas import GroupSpec, JobKind, JobResult, JobSpec, NodeInfo, Placement, Progress
from jobs.settings import Settings
from jobs.store import JobStore
from jobs.submit import admit_data
from ring_worker.runtime.job_io import RedisJobIO
from tests.jobs.test_admit_plan import GPUS, SETTINGS
from tests.jobs.test_admit_plan import job as planned_job


@pytest.fixture
def settings(short_tmp_path) -> Settings:
    return Settings(home=short_tmp_path, redis_url=None, max_retries=2, reservation_lease_s=5)


@pytest.fixture
def store(redis_conn) -> JobStore:
    return JobStore(redis_conn)


def place(store: JobStore, job_id: str, group_id: str, nodes=("n0", "n1")) -> GroupSpec:
    """What the dispatcher does at admission, minus the ranks."""
    store.transition(
        job_id,
        JobState.ADMITTED,
        placement=Placement(
            strategy="ring",
            ranks=len(nodes),
            nodes=list(nodes),
            group_id=group_id,
            bytes_per_node=1,
        ),
        progress=Progress(phase=JobState.ADMITTED, total=10),
    )
    group = GroupSpec(
        group_id=group_id,
        job_id=job_id,
        model="random:tiny-llama",
        nodes=list(nodes),
        addresses=[f"127.0.0.1:{30000 + i}" for i in range(len(nodes))],
    )
    track_group(store.conn, group)
    return group


def new_job(store: JobStore, job_id: str = "j1") -> str:
    store.create(job_id, JobSpec(kind=JobKind.PREFILL, document="x", model="random:tiny-llama"))
    return job_id


def admissions(store: JobStore) -> list[str]:
    from jobs.submit import admit_queue

    return admit_queue(store.conn).job_ids


def test_a_lost_group_requeues_its_job_with_a_new_admission(store, settings):
    job = new_job(store)
    place(store, job, "g1")
    assert lose_group(store.conn, settings, job, "g1", "rank 1 was killed by signal 9") == "retried"
    record = store.get(job)
    assert record.state == JobState.QUEUED and record.placement is None
    assert record.attempt == 1 and record.retry_reasons == ["rank 1 was killed by signal 9"]
    assert "retry 1" in (record.waiting_reason or "")
    assert admissions(store) == [f"admit-{job}-attempt1"]
    assert store.conn.exists(keys.group_failed("g1"))  # its agents stop the group's other ranks
    # a second report of the same group (another agent, the reconciler) changes nothing
    assert lose_group(store.conn, settings, job, "g1", "rank 0 exited with code 1") is None
    assert store.get(job).attempt == 1 and len(admissions(store)) == 1


def test_retries_are_bounded_and_the_failure_keeps_every_reason(store, settings):
    job = new_job(store)
    for attempt, group in enumerate(["g1", "g2", "g3"]):
        if attempt:
            store.transition(job, JobState.ADMITTED)  # the dispatcher places the retry
        place_again = place if not attempt else place_retry
        place_again(store, job, group)
        lose_group(store.conn, settings, job, group, f"link down #{attempt}")
    final = store.get(job)
    assert final.state == JobState.FAILED and final.attempt == 2
    assert final.error is not None and final.error.startswith("link down #2")
    assert "link down #0" in final.error and "link down #1" in final.error


def place_retry(store: JobStore, job_id: str, group_id: str) -> None:
    record = store.get(job_id)
    placement = Placement(
        strategy="single", ranks=1, nodes=["n0"], group_id=group_id, bytes_per_node=1
    )
    store.conn.hset(keys.job(job_id), "placement", placement.model_dump_json())
    assert record.state == JobState.ADMITTED


def test_a_failure_no_placement_can_fix_is_not_retried(store, settings):
    job = new_job(store)
    place(store, job, "g1")
    report_group_failure(store.conn, "g1", "rank 0: cannot load model m: truncated", retry=False)
    assert lose_group(store.conn, settings, job, "g1", "rank 0 exited with code 1") == "failed"
    final = store.get(job)
    assert (
        final.state == JobState.FAILED and final.error == "rank 0: cannot load model m: truncated"
    )
    assert admissions(store) == []


def test_ranks_of_a_lost_group_cannot_touch_its_retry(store, settings):
    job = new_job(store)
    place(store, job, "g1")
    stale = RedisJobIO(store, job, "g1")
    stale.enter(JobState.LOADING, 10)
    lose_group(store.conn, settings, job, "g1", "node n1 stopped answering")
    store.transition(job, JobState.ADMITTED)
    place_retry(store, job, "g2")
    result = JobResult(
        prompt_tokens=10,
        generated_tokens=0,
        prompt_tps=1.0,
        generation_tps=0.0,
        load_s=0.0,
        prefill_s=1.0,
        decode_s=0.0,
        peak_memory_bytes=[1],
    )
    with pytest.raises(StaleGroupError, match="no longer placed on group g1"):
        stale.progress(Progress(phase=JobState.PREFILL, processed=5, total=10))
    with pytest.raises(StaleGroupError):
        stale.enter(JobState.PREFILL, 10)
    with pytest.raises(StaleGroupError):
        stale.finish(result)
    current = RedisJobIO(store, job, "g2")
    current.enter(JobState.LOADING, 10)
    current.enter(JobState.PREFILL, 10)
    current.finish(result)
    assert store.get(job).state == JobState.FINISHED


def result_of(prompt_tokens: int) -> JobResult:
    return JobResult(
        prompt_tokens=prompt_tokens,
        generated_tokens=0,
        prompt_tps=1.0,
        generation_tps=0.0,
        load_s=0.0,
        prefill_s=1.0,
        decode_s=0.0,
        peak_memory_bytes=[1],
    )


def test_a_lost_group_cannot_finish_or_fail_its_running_retry(store, settings):
    """The race: group g1 is lost mid-prefill but its rank 0 lives on (a stalled link that
    recovers); the retry runs on g2 and is in PREFILL, legal to finish from, when g1's late
    finish() and fail() arrive. Only the fence (the job's placement names g2) stops them."""
    job = new_job(store)
    place(store, job, "g1")
    stale = RedisJobIO(store, job, "g1")
    stale.enter(JobState.LOADING, 10)
    stale.enter(JobState.PREFILL, 10)
    assert lose_group(store.conn, settings, job, "g1", "rank 1 stalled") == "retried"
    store.transition(job, JobState.ADMITTED)
    place_retry(store, job, "g2")
    retry = RedisJobIO(store, job, "g2")
    retry.enter(JobState.LOADING, 10)
    retry.enter(JobState.PREFILL, 10)
    retry.progress(Progress(phase=JobState.PREFILL, processed=5, total=10))
    running = store.get(job)
    with pytest.raises(StaleGroupError, match="no longer placed on group g1"):
        stale.finish(result_of(prompt_tokens=111))
    stale.fail("rank 0: late error of the lost group")  # recorded for g1 only
    # what g1's node agent does next with that report: nothing, the job moved on
    assert lose_group(store.conn, settings, job, "g1", "rank 0 exited with code 1") is None
    with pytest.raises(StaleGroupError):
        store.transition(job, JobState.FAILED, group_id="g1", error="late")
    assert store.get(job) == running  # still g2's, in PREFILL, untouched
    assert not store.conn.exists(keys.group_failed("g2"))
    assert admissions(store) == [f"admit-{job}-attempt1"]  # no second retry was queued
    retry.finish(result_of(prompt_tokens=10))
    final = store.get(job)
    assert final.state == JobState.FINISHED and final.result == result_of(prompt_tokens=10)
    assert final.attempt == 1 and final.error is None


def put_node(store: JobStore, name: str, heartbeat_at: float | None = None) -> None:
    now = time.time()
    store.put_node(
        NodeInfo(
            name=name,
            backend="cpu",
            memory_bytes=2**30,
            available_bytes=2**30,
            address="127.0.0.1",
            pid=1,
            started_at=now,
            heartbeat_at=heartbeat_at or now,
        ),
        ttl_s=60,
    )


def test_the_reconciler_retries_a_group_on_a_node_that_stopped_heartbeating(store, settings):
    job = new_job(store)
    place(store, job, "g1")
    put_node(store, "n0")
    put_node(store, "n1", heartbeat_at=time.time() - 60)  # its agent was killed a minute ago
    assert reconcile(store.conn, settings) == ["g1"]
    record = store.get(job)
    assert (
        record.state == JobState.QUEUED and "node n1 stopped answering" in record.retry_reasons[0]
    )
    assert store.conn.hlen(keys.GROUPS_INDEX) == 0


def test_a_retry_waits_for_every_live_node_to_be_heard_from_again(store, settings):
    job = new_job(store)
    place(store, job, "g1")
    lose_group(store.conn, settings, job, "g1", "rank 1 was killed by signal 9")
    record = store.get(job)
    lost_at = record.updated_at
    put_node(store, "n0", heartbeat_at=lost_at + 0.5)  # heard since: alive
    put_node(store, "n1", heartbeat_at=lost_at - 0.5)  # not yet: it may have died with the group
    assert retry_waits(record, store.live_nodes(), settings)
    put_node(store, "n1", heartbeat_at=lost_at + 1.0)  # its next heartbeat
    assert not retry_waits(record, store.live_nodes(), settings)
    # a node that stays silent holds the retry no longer than the time it takes to go stale
    put_node(store, "n1", heartbeat_at=lost_at - 0.5)
    later = record.model_copy(update={"updated_at": time.time() - retry_delay_s(settings)})
    assert not retry_waits(later, store.live_nodes(), settings)
    # a first attempt never waits
    assert not retry_waits(store.get(new_job(store, "j2")), store.live_nodes(), settings)


def test_the_reconciler_retries_a_group_whose_lease_nobody_renews(store, settings):
    job = new_job(store)
    group = place(store, job, "g1")
    put_node(store, "n0")
    put_node(store, "n1")
    reservations = Reservations(store.conn, lease_s=settings.reservation_lease_s)
    reservations.reserve("g1", {"n0": (1, 10), "n1": (1, 10)})
    assert reconcile(store.conn, settings) == []  # just admitted, lease fresh
    entry = {"group": group.model_dump(mode="json"), "admitted_at": time.time() - 60}
    store.conn.hset(keys.GROUPS_INDEX, "g1", json.dumps(entry))
    assert reconcile(store.conn, settings) == []  # the lease is still live: ranks are running
    for node in ("n0", "n1"):  # the agents stop renewing (they died with their ranks)
        store.conn.zadd(keys.node_leases(node), {"g1": time.time() - 1})
    assert reconcile(store.conn, settings) == ["g1"]
    assert "no node agent renewed" in store.get(job).retry_reasons[0]


def test_the_reconciler_forgets_groups_whose_job_ended(store, settings):
    job = new_job(store)
    place(store, job, "g1")
    store.fail(job, "done with it")
    assert reconcile(store.conn, settings) == []
    assert store.conn.hlen(keys.GROUPS_INDEX) == 0


def test_a_group_tracked_for_a_job_not_yet_admitted_is_kept_until_the_lease_time(store, settings):
    """The dispatcher tracks a group before it admits the job, so that a dispatcher killed in
    between leaves a queued job (RQ admits it again), never an admitted one nobody watches."""
    job = new_job(store)
    group = GroupSpec(
        group_id="g1",
        job_id=job,
        model="random:tiny-llama",
        nodes=["n0"],
        addresses=["127.0.0.1:30000"],
    )
    track_group(store.conn, group)  # the job is still queued: its admission is in flight
    assert reconcile(store.conn, settings) == []
    assert store.conn.hexists(keys.GROUPS_INDEX, "g1")
    stale = {"group": group.model_dump(mode="json"), "admitted_at": time.time() - 60}
    store.conn.hset(keys.GROUPS_INDEX, "g1", json.dumps(stale))  # its dispatcher died then
    assert reconcile(store.conn, settings) == []
    assert not store.conn.hexists(keys.GROUPS_INDEX, "g1")
    assert store.get(job).state == JobState.QUEUED


def test_a_group_entry_changed_since_it_was_read_is_not_forgotten(store, settings):
    """The reconciler read a warm group's entry for its finished job; the dispatcher then
    handed the group its next job. Dropping the entry now would leave that job unwatched."""
    first, second = new_job(store, "j1"), new_job(store, "j2")
    group = place(store, first, "g1")
    seen = store.conn.hget(keys.GROUPS_INDEX, "g1")
    track_group(store.conn, group.model_copy(update={"job_id": second}))
    assert not forget_group(store.conn, "g1", seen)
    assert current_job(store.conn, "g1", first) == second
    assert forget_group(store.conn, "g1", store.conn.hget(keys.GROUPS_INDEX, "g1"))
    assert store.conn.hlen(keys.GROUPS_INDEX) == 0


def test_status_shows_the_retries(store, settings):
    job = new_job(store)
    place(store, job, "g1")
    lose_group(store.conn, settings, job, "g1", "rank 1 was killed by signal 9")
    record = store.get(job)
    assert "retry 1: rank 1 was killed by signal 9" in describe(record)
    payload = status_json(record)
    assert payload["attempt"] == 1 and payload["retry_reasons"] == ["rank 1 was killed by signal 9"]


def test_an_admission_taken_by_a_dispatcher_that_died_is_put_back(store):
    """RQ moves a dequeued job to an intermediate list before it starts it; a dispatcher killed
    in between leaves the admission there (RQ looks again every 10 minutes)."""
    from jobs.submit import admit_queue

    job = new_job(store)
    queue = admit_queue(store.conn)
    queue.enqueue_many([admit_data(job)])
    parked = queue.intermediate_queue
    store.conn.lmove(queue.key, parked.key, "LEFT", "RIGHT")  # what a dequeue does first
    assert queue.job_ids == [] and parked.get_job_ids() == [f"admit-{job}"]
    assert rescue_dequeued(queue) == []  # first sighting: maybe a live dispatcher's
    store.conn.set(parked.get_first_seen_key(f"admit-{job}"), time.time() - 60)
    assert rescue_dequeued(queue) == [f"admit-{job}"]
    assert queue.job_ids == [f"admit-{job}"] and parked.get_job_ids() == []


def test_an_unreadable_failure_record_fails_the_job_and_says_so(store, settings):
    job = new_job(store)
    place(store, job, "g1")
    store.conn.set(keys.group_failed("g1"), '{"reason": "half a record"')  # cut short
    assert lose_group(store.conn, settings, job, "g1", "rank 0 exited with code 1") == "failed"
    final = store.get(job)
    assert final.state == JobState.FAILED and "unreadable failure record" in (final.error or "")
    assert admissions(store) == []


DISPATCHER_STAND_IN = """
import sys
from jobs.redis_server import connect
from jobs.submit import admit_queue
from jobs.workers import DISPATCHER_ROLE, service_worker
conn = connect(sys.argv[1])
service_worker(admit_queue(conn), conn, DISPATCHER_ROLE).work(burst=True)
"""


def test_an_admission_whose_dispatcher_was_killed_is_retried_at_once(redis_url, store):
    """A real RQ worker named as a dispatcher starts an admission and is killed: the reconciler
    expires its entry at once (not after the admission's 65 s), and RQ's cleanup retries it."""
    import subprocess
    import sys

    from rq import Queue, Retry

    from jobs.recovery import expire_admissions_of_dead_dispatchers
    from jobs.submit import admit_queue

    queue = admit_queue(store.conn)
    queue.enqueue_many(
        [Queue.prepare_data("time.sleep", (60,), job_id="admit-j1", timeout=60, retry=Retry(3))]
    )
    worker = subprocess.Popen([sys.executable, "-c", DISPATCHER_STAND_IN, redis_url])
    try:
        deadline = time.monotonic() + 60
        while "admit-j1" not in queue.started_job_registry.get_job_ids(cleanup=False):
            assert time.monotonic() < deadline and worker.poll() is None, "never started"
            time.sleep(0.05)
        assert expire_admissions_of_dead_dispatchers(queue) == []  # its dispatcher lives
        worker.kill()
        worker.wait()
        assert expire_admissions_of_dead_dispatchers(queue) == ["admit-j1"]
    finally:
        worker.kill()
        worker.wait()
    queue.started_job_registry.cleanup()
    assert queue.job_ids == ["admit-j1"]  # retried: back on the queue
    assert queue.started_job_registry.get_job_ids(cleanup=False) == []


@pytest.mark.parametrize(
    ("name", "gone"),
    [
        ("ringq-dispatcher-elsewhere-1", False),  # another host: cannot be told
        ("rq:worker:abc", False),  # not ours
        ("ringq-node-{host}-{pid}", False),  # another role
        ("ringq-dispatcher-{host}-{pid}", False),  # this very process: alive
        ("ringq-dispatcher-{host}-{dead}", True),
    ],
)
def test_died_here(name, gone):
    import socket
    import subprocess
    import sys

    from jobs.workers import DISPATCHER_ROLE, died_here

    finished = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        stdout=subprocess.PIPE,
        text=True,
        check=True,
    )
    name = name.format(host=socket.gethostname(), pid=os.getpid(), dead=finished.stdout.strip())
    assert died_here(name, DISPATCHER_ROLE) is gone


@pytest.mark.parametrize(
    ("first", "latest", "resumes"),
    [
        ("rank 0 on node g1: stalled for 300 s", "rank 1 was killed by signal 9", True),
        ("rank 1 was killed by signal 9", "rank 0 on node g1: stalled for 300 s", False),
    ],
)
def test_the_latest_loss_not_the_first_decides_where_a_retry_resumes(
    store, settings, first, latest, resumes
):
    """Two groups lost in turn (lose_group records each reason, in order), a complete ring-2
    checkpoint on g1, g0 (its ranks' marks): the dispatcher's plan (jobs/admit_plan.py
    plan_resume) goes back to the checkpoint unless the LATEST loss was a stall."""
    job = new_job(store)
    place(store, job, "lost1", nodes=("g1", "g0"))
    assert lose_group(store.conn, settings, job, "lost1", first) == "retried"
    store.transition(job, JobState.ADMITTED)
    place_retry(store, job, "lost2")
    assert lose_group(store.conn, settings, job, "lost2", latest) == "retried"
    for rank, node in enumerate(("g1", "g0")):
        mark = CheckpointMark(strategy="ring", kv_layout="replicated", ranks=2, node=node,
                              tokens=98304)  # fmt: skip
        mark_checkpoint(store.conn, job, rank, mark, ttl_s=60)

    record = store.get(job)
    assert record.retry_reasons == [first, latest] and record.attempt == 2
    shaped = planned_job(131072)  # the 8B shape, 128K tokens: a ring if it goes back
    retry = Job(record, shaped.tokens, shaped.shape, shaped.model_dtype,
                checkpoint=checkpoint_hint(read_marks(store.conn, job)))  # fmt: skip
    decision = plan_admission(retry, Cluster(GPUS, {}, []), SETTINGS)
    assert isinstance(decision, Place)
    if resumes:
        assert decision.plan.nodes == ("g1", "g0")
        assert "continues from its checkpoint at 98304 tokens" in decision.reason
    else:
        assert decision.plan.layout.strategy == "single" and "checkpoint" not in decision.reason
