"""Dispatcher.commit (jobs/dispatcher.py) when the warm group it was given is no longer idle by
the time it claims it, in a real Redis: nothing is recorded on the job (still QUEUED, no
placement), the admission waits and is queued again, and the bytes the commit reserved for a
group that retired are given back (no agent renews them: they would block the node until their
lease ran out)."""

import time

import pytest

from jobs import keys
from jobs.admit_plan import Cluster, Job, Place, plan_admission
from jobs.dispatcher import Dispatcher
from jobs.lifecycle import JobState
from jobs.model_catalog import read_model_shape, resolve_model
from jobs.schemas import GroupSpec, JobKind, JobSpec, NodeInfo
from jobs.settings import Settings

GIB = 1024**3
MODEL = "random:llama-3.1-8b"


def gpu(name: str, index: int) -> NodeInfo:
    return NodeInfo(
        name=name,
        backend="cuda",
        memory_bytes=130 * GIB,
        available_bytes=130 * GIB,
        address="127.0.0.1",
        device=f"cuda:{index} NVIDIA H200",
        gpu=f"hostA/{index}",
        pid=1,
        started_at=0.0,
        heartbeat_at=time.time(),
    )


GPUS = [gpu("g0", 0), gpu("g1", 1)]


@pytest.fixture
def dispatcher(redis_conn, short_tmp_path) -> Dispatcher:
    settings = Settings(home=short_tmp_path, redis_url=None, admit_retry_s=0.01, job_ttl_s=600)
    return Dispatcher(redis_conn, settings)


def queued_job(dispatcher: Dispatcher, tokens: int) -> Job:
    spec = JobSpec(kind=JobKind.PREFILL, document="x", model=MODEL)
    record = dispatcher.store.create("j1", spec)
    shape = read_model_shape(resolve_model(MODEL, allowed_dirs=None), dtype="float32")
    return Job(record, list(range(tokens)), shape, "bfloat16")


def warm_place(dispatcher: Dispatcher, job: Job, held_bytes: int) -> Place:
    """A warm group (as a fresh placement of this job makes it) that holds `held_bytes` on each
    node and waits idle, and the plan that reuses it for `job`."""
    fresh = plan_admission(job, Cluster(GPUS, {}, []), dispatcher.settings)
    assert isinstance(fresh, Place)
    group = GroupSpec.from_plan(
        fresh.plan,
        group_id="warm1",
        job_id="earlier",
        model=MODEL,
        addresses=["127.0.0.1:1", "127.0.0.1:2"],
        idle_s=60,
    )
    needs = {n.name: (held_bytes, n.memory_bytes) for n in GPUS}
    assert dispatcher.reservations.reserve(group.group_id, needs) is None
    dispatcher.warm.offer(group, held_bytes, fresh.plan.chunk_tokens)
    dispatcher.conn.set(keys.group_idle(group.group_id), "1")
    held = {n.name: {group.group_id: held_bytes} for n in GPUS}
    place = plan_admission(job, Cluster(GPUS, held, dispatcher.warm.idle()), dispatcher.settings)
    assert isinstance(place, Place) and place.reuse == group
    return place


def retire(dispatcher: Dispatcher, group: GroupSpec) -> None:
    """What rank 0 does as it retires (jobs/warm_groups.py _RETIRE), and its node agents after
    its ranks exit (they release its reservation)."""
    dispatcher.conn.delete(keys.group_idle(group.group_id))
    dispatcher.conn.hdel(keys.WARM_GROUPS, group.group_id)
    dispatcher.release(group)


def assert_still_queued(dispatcher: Dispatcher, outcome: str) -> None:
    assert outcome == "waiting"
    record = dispatcher.store.get("j1")
    assert record.state == JobState.QUEUED and record.placement is None
    assert record.waiting_reason == "the warm group it was given retired; retrying"
    assert dispatcher.queue.count == 1  # admitted again soon


def reserved(dispatcher: Dispatcher, group_id: str) -> list[int | None]:
    return [dispatcher.reservations.held(n.name).get(group_id) for n in GPUS]


def test_a_group_that_retired_before_the_claim_gets_back_what_the_commit_reserved(dispatcher):
    job = queued_job(dispatcher, 131072)
    place = warm_place(dispatcher, job, held_bytes=GIB)  # less than the job needs: it grows
    assert place.bytes_per_node > place.held_bytes
    group = place.reuse
    assert group is not None
    retire(dispatcher, group)
    outcome = dispatcher.commit(job, place, {n.name: n for n in GPUS})
    assert_still_queued(dispatcher, outcome)
    assert reserved(dispatcher, group.group_id) == [None, None]


def test_a_group_another_dispatcher_claimed_keeps_its_reservation(dispatcher):
    job = queued_job(dispatcher, 131072)
    place = warm_place(dispatcher, job, held_bytes=GIB)
    group = place.reuse
    assert group is not None
    assert dispatcher.warm.claim(group, "another-job")  # busy now, running that job
    outcome = dispatcher.commit(job, place, {n.name: n for n in GPUS})
    assert_still_queued(dispatcher, outcome)
    assert None not in reserved(dispatcher, group.group_id)  # the running group still holds one


def test_a_group_that_held_enough_is_left_as_it_was(dispatcher):
    job = queued_job(dispatcher, 131072)
    place = warm_place(dispatcher, job, held_bytes=100 * GIB)  # more than the job needs
    assert place.held_bytes >= place.bytes_per_node
    group = place.reuse
    assert group is not None
    dispatcher.conn.delete(keys.group_idle(group.group_id))  # retiring: its agents release it
    outcome = dispatcher.commit(job, place, {n.name: n for n in GPUS})
    assert_still_queued(dispatcher, outcome)
    assert reserved(dispatcher, group.group_id) == [100 * GIB, 100 * GIB]
