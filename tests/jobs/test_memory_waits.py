"""The head-of-line hold through the dispatcher, in a real Redis (jobs/memory_waits.py keeps the
holds; jobs/admit_plan.py states the rule): a ring of two waiting behind single jobs on both
GPUs is not overtaken by single jobs submitted after it, and a hold ends with its job's wait."""

import threading
import time

import pytest

from jobs import keys
from jobs.admit_plan import Wait
from jobs.dispatcher import Dispatcher
from jobs.head_hold import HeadHold
from jobs.lifecycle import JobState
from jobs.memory_waits import MemoryWaits
from jobs.schemas import JobKind, JobRecord, JobSpec
from jobs.settings import Settings
from jobs.submit import enqueue_jobs
from tests.jobs.test_admit_plan import GIB, gpu

MODEL = "random:llama-3.1-8b"


@pytest.fixture
def dispatcher(redis_conn, short_tmp_path) -> Dispatcher:
    # heartbeats 30 s apart: the first admission imports the tokenizer's libraries (seconds)
    settings = Settings(
        home=short_tmp_path,
        redis_url=None,
        admit_retry_s=0.01,
        job_ttl_s=600,
        group_idle_s=0,
        node_heartbeat_s=30,
        node_ttl_s=60,
    )
    dispatcher = Dispatcher(redis_conn, settings)
    for index, name in enumerate(("g0", "g1")):
        dispatcher.store.put_node(gpu(name, index), ttl_s=60)
    return dispatcher


def submit(dispatcher: Dispatcher, job_id: str, **spec_fields) -> JobRecord:
    document = f"{job_id} " * 1000  # its own: no job waits for another's prefix
    spec = JobSpec(kind=JobKind.PREFILL, document=document, model=MODEL, **spec_fields)
    record = dispatcher.store.create(job_id, spec)
    time.sleep(0.01)  # queue order is created_at: one after the other
    return record


def run_single_job(dispatcher: Dispatcher, group_id: str, node: str) -> None:
    """A running one-node group, as its admission reserved it (its agent renews the lease)."""
    assert dispatcher.reservations.reserve(group_id, {node: (20 * GIB, 130 * GIB)}) is None


def end_single_job(dispatcher: Dispatcher, group_id: str, node: str) -> None:
    dispatcher.reservations.release(group_id, node)  # what its agent does as its rank exits


def test_single_jobs_submitted_later_do_not_overtake_a_ring_waiting_for_memory(dispatcher):
    """The chaos soak's starvation: a ring-2 waited 205 s while each GPU that freed went to a
    one-node job queued behind it. Now: g0 frees, a later job waits (g0 is held for the
    ring); g1 frees, the ring runs on both; the later job then waits for a GPU, as the head."""
    run_single_job(dispatcher, "run-a", "g0")
    run_single_job(dispatcher, "run-b", "g1")
    submit(dispatcher, "ring", ranks=2)
    assert dispatcher.admit("ring") == "waiting"
    assert "running groups hold" in (dispatcher.store.get("ring").waiting_reason or "")
    end_single_job(dispatcher, "run-a", "g0")
    submit(dispatcher, "small", ranks=1)
    assert dispatcher.admit("small") == "waiting"  # without the hold: admitted on g0
    small = dispatcher.store.get("small")
    assert small.state == JobState.QUEUED and small.placement is None
    assert "waiting behind job ring" in (small.waiting_reason or "")
    end_single_job(dispatcher, "run-b", "g1")
    submit(dispatcher, "small2", ranks=1)
    assert dispatcher.admit("small2") == "waiting"
    assert dispatcher.admit("small") == "waiting"
    assert dispatcher.admit("ring") == "admitted"
    ring = dispatcher.store.get("ring")
    assert ring.placement is not None and ring.placement.nodes == ["g0", "g1"]
    assert dispatcher.admit("small") == "waiting"  # both GPUs run the ring now
    reason = dispatcher.store.get("small").waiting_reason or ""
    assert reason.startswith("waiting for memory that running groups hold")
    head = MemoryWaits(dispatcher.conn).head(dispatcher.store.get("small2"))
    assert head is not None and head.job_id == "small"  # the ring's hold ended as it was placed


def test_a_hold_ends_when_its_job_is_cancelled_or_stops_renewing_it(dispatcher):
    """Cancelled (no dispatcher says so): the next reader drops it. Not renewed within its
    lease: dropped too. Either way the later job plans around no hold."""
    waits = MemoryWaits(dispatcher.conn)
    head, after = submit(dispatcher, "head"), submit(dispatcher, "after")
    waits.record(head, {"g0": GIB, "g1": GIB})
    assert waits.head(after) == HeadHold("head", {"g0": GIB, "g1": GIB})
    dispatcher.store.end("head", JobState.CANCELLED, "cancelled")
    assert waits.head(after) is None
    assert dispatcher.conn.zcard(keys.MEMORY_WAITS) == 0  # and forgotten
    lapsing = MemoryWaits(dispatcher.conn, lease_s=0)
    second = submit(dispatcher, "second")
    lapsing.record(second, {"g0": GIB})
    last = submit(dispatcher, "last")
    assert waits.head(last) is None


def test_a_job_older_than_the_head_is_not_held_back_and_the_head_sees_its_own_hold(dispatcher):
    """A retry keeps its first created_at: it comes before a head submitted after it."""
    waits = MemoryWaits(dispatcher.conn)
    older, head = submit(dispatcher, "older"), submit(dispatcher, "head")
    waits.record(head, {"g0": GIB, "g1": GIB})
    assert waits.head(older) is None
    assert waits.head(head) == HeadHold("head", {"g0": GIB, "g1": GIB})
    waits.record(older, {"g1": GIB})
    assert waits.head(head) == HeadHold("older", {"g1": GIB})


def test_a_wait_is_logged_once_per_reason(dispatcher, caplog):
    record = submit(dispatcher, "w1")
    caplog.set_level("INFO", logger="jobs.dispatcher")
    for reason in ("waiting for A", "waiting for A", "waiting for A", "waiting for B"):
        dispatcher.wait(dispatcher.store.get(record.id), Wait(reason))
    logged = [r.getMessage() for r in caplog.records if "waits:" in r.getMessage()]
    assert logged == ["job w1 waits: waiting for A", "job w1 waits: waiting for B"]


def test_a_retry_goes_ahead_of_first_attempts_submitted_before_it(dispatcher):
    """A job that lost its group to a fault had its turn: ordered by created_at alone, a retry
    of a job submitted with a thousand others waited behind all the older ones (12-33 min in
    the 1,000-job chaos soak)."""
    waits = MemoryWaits(dispatcher.conn)
    first, retried = submit(dispatcher, "first"), submit(dispatcher, "retried")
    waits.record(first, {"g0": GIB, "g1": GIB})
    retry = retried.model_copy(update={"attempt": 1})
    assert waits.head(retry) is None  # nothing waits ahead of it
    waits.record(retry, {"g0": GIB})
    assert waits.head(first) == HeadHold("retried", {"g0": GIB})


def test_jobs_enqueued_together_wait_in_the_order_given(dispatcher):
    """One pipeline writes them with one clock reading: equal created_at made the queue order
    the ids' (random), so a batch's lines ran in any order, one at a time (an H200 run of 32)."""
    run_single_job(dispatcher, "run-a", "g0")
    run_single_job(dispatcher, "run-b", "g1")
    names = ["zz", "mm", "aa"]  # against the ids' order
    specs = [JobSpec(kind=JobKind.PREFILL, document=f"{n} " * 1000, model=MODEL) for n in names]
    jobs = list(zip(names, specs, strict=True))
    records = enqueue_jobs(dispatcher.conn, jobs, settings=dispatcher.settings)
    assert [r.created_at for r in records] == sorted({r.created_at for r in records})
    for name in names:
        assert dispatcher.admit(name) == "waiting"
    assert MemoryWaits(dispatcher.conn).first() == "zz"
    head = MemoryWaits(dispatcher.conn).head(dispatcher.store.get("aa"))
    assert head is not None and head.job_id == "zz"


def test_room_that_frees_ends_the_pause_and_the_head_tries_first(dispatcher):
    """A waiting job pauses RINGQ_ADMIT_RETRY_S (a round; 30 s here) before it tries again. A
    released reservation wakes the pause, and a try of the head goes to the front of the admit
    queue, ahead of the waiting job's own retry; a wake's try that waits again queues none."""
    dispatcher.settings = dispatcher.settings.model_copy(update={"admit_retry_s": 30.0})
    run_single_job(dispatcher, "run-a", "g0")
    run_single_job(dispatcher, "run-b", "g1")
    head, later = submit(dispatcher, "head", ranks=2), submit(dispatcher, "later")
    assert dispatcher.memory_waits.first() is None
    dispatcher.conn.delete(keys.ADMIT_WAKE)
    threading.Timer(0.5, end_single_job, (dispatcher, "run-a", "g0")).start()  # wakes
    began = time.monotonic()
    assert dispatcher.admit(later.id) == "waiting"  # behind nothing: it is the head
    assert time.monotonic() - began < 15  # not the 30 s pause
    queued = [(job.args, job.kwargs) for job in dispatcher.queue.get_jobs()]
    assert queued == [(["later"], {"wake": True}), (["later"], {})]
    dispatcher.conn.lpush(keys.ADMIT_WAKE, "1")  # no pause this time
    assert dispatcher.admit(head.id, again=False) == "waiting"  # a ring: needs both GPUs
    queued = [(job.args, job.kwargs) for job in dispatcher.queue.get_jobs()]
    # the head now is the older job: its try goes first; the wake's try queued no retry
    assert queued == [(["head"], {"wake": True}), (["later"], {"wake": True}), (["later"], {})]
