"""Dispatcher.prefix_hint (jobs/dispatcher.py, jobs/prefix_index.py read_hint) in a real Redis:
a later job on the same document waits for a pending-prefix marker only while the job that left
it may still keep its KV; the marker of a job that ended (failed, cancelled, gone, finished past
its grace) holds no one, though it stays in Redis until its TTL."""

import json
import time

import pytest

from admission.estimate import BatchRow
from jobs import keys
from jobs.admit_plan import Cluster, Job, Place, Wait, plan_admission
from jobs.dispatcher import Dispatcher
from jobs.lifecycle import JobState
from jobs.model_catalog import read_model_shape, resolve_model
from jobs.prefix_cache import (
    BLOCK_TOKENS,
    PENDING_GRACE_S,
    PENDING_TTL_S,
    PrefixHint,
    wait_for_pending,
)
from jobs.prefix_index import PendingPrefixes, model_key
from jobs.schemas import GroupSpec, JobKind, JobSpec
from jobs.settings import Settings
from tests.jobs.test_dispatcher_commit import GPUS, MODEL

DOCUMENT = list(range(16 * BLOCK_TOKENS))
QUESTION = DOCUMENT + list(range(100))


@pytest.fixture
def dispatcher(redis_conn, short_tmp_path) -> Dispatcher:
    settings = Settings(home=short_tmp_path, redis_url=None, prefix_cache="on", job_ttl_s=600)
    return Dispatcher(redis_conn, settings)


RUNNING = [JobState.ADMITTED, JobState.LOADING, JobState.PREFILL]
PATHS = {  # the transitions that bring the marker's job to each state
    "admitted": RUNNING[:1],
    "prefill": RUNNING,
    "finished": [*RUNNING, JobState.FINISHED],
    "finished long ago": [*RUNNING, JobState.FINISHED],
    "failed": [*RUNNING, JobState.FAILED],
    "cancelled": [*RUNNING, JobState.CANCELLED],
}


def owner_in(dispatcher: Dispatcher, state: str) -> str:
    """The marker's job in `state` ("gone": no record at all; "finished long ago": finished
    PENDING_GRACE_S and more before now)."""
    if state == "gone":
        return "gone-job"
    store = dispatcher.store
    store.create("owner", JobSpec(kind=JobKind.PREFILL, document="x", model=MODEL))
    for step in PATHS[state]:
        store.transition("owner", step)
    if state == "finished long ago":
        aged = time.time() - PENDING_GRACE_S - 5
        dispatcher.conn.hset(keys.job("owner"), "updated_at", json.dumps(aged))
    return "owner"


@pytest.mark.parametrize(
    ("owner_state", "holds"),
    [
        ("admitted", True),
        ("prefill", True),
        ("finished", True),  # its ranks are keeping the KV the question will reuse
        ("finished long ago", False),
        ("failed", False),
        ("cancelled", False),
        ("gone", False),  # its record expired
    ],
)
def test_a_marker_of_an_ended_job_holds_no_later_job(dispatcher, owner_state, holds):
    owner = owner_in(dispatcher, owner_state)
    PendingPrefixes(dispatcher.conn, PENDING_TTL_S).mark(owner, model_key(MODEL), DOCUMENT)
    record = dispatcher.store.create(
        "later", JobSpec(kind=JobKind.PREFILL, document="y", model=MODEL)
    )
    hint = dispatcher.prefix_hint(record, QUESTION)
    assert hint.pending_job == (owner if holds else None)
    assert (wait_for_pending(hint, len(QUESTION)) is not None) is holds

    shape = read_model_shape(resolve_model(MODEL, allowed_dirs=None), dtype="float32")
    decision = plan_admission(
        Job(record, QUESTION, shape, "bfloat16", hint), Cluster(GPUS, {}, []), dispatcher.settings
    )
    assert isinstance(decision, Wait if holds else Place), decision
    if holds:
        assert f"waiting for job {owner}" in decision.reason


def test_a_jobs_own_marker_does_not_hold_its_retry(dispatcher):
    """A retried job finds the marker its first attempt left: not a reason to wait for itself."""
    spec = JobSpec(kind=JobKind.PREFILL, document="x", model=MODEL)
    record = dispatcher.store.create("retried", spec)
    PendingPrefixes(dispatcher.conn, PENDING_TTL_S).mark("retried", model_key(MODEL), DOCUMENT)
    assert dispatcher.prefix_hint(record, QUESTION).pending_job is None


def busy_single(dispatcher: Dispatcher, node: str, running: str) -> GroupSpec:
    """A warm single group on GPU `node`, busy with job `running` (in its batch), holding
    20 GiB reserved there."""
    [info] = [n for n in GPUS if n.name == node]
    probe = queued_question(dispatcher, f"probe-{node}", PrefixHint())
    fresh = plan_admission(probe, Cluster([info], {}, []), dispatcher.settings)
    assert isinstance(fresh, Place)
    group = GroupSpec.from_plan(
        fresh.plan, group_id=f"warm-{node}", job_id=running, model=MODEL,
        addresses=["127.0.0.1:1"], idle_s=60,
    )  # fmt: skip
    held, budget = 20 * 1024**3, info.memory_bytes
    dispatcher.store.put_node(info.model_copy(update={"heartbeat_at": time.time()}), ttl_s=60)
    assert dispatcher.reservations.reserve(group.group_id, {node: (held, budget)}) is None
    dispatcher.warm.offer(group, held, fresh.plan.chunk_tokens)
    dispatcher.warm.started(group, running, BatchRow(len(DOCUMENT), 16))
    return group


def queued_question(dispatcher: Dispatcher, job_id: str, hint: PrefixHint) -> Job:
    spec = JobSpec(kind=JobKind.GENERATE, document="x", model=MODEL, max_tokens=16)
    record = dispatcher.store.create(job_id, spec)
    dispatcher.store.set_tokens(job_id, QUESTION)
    shape = read_model_shape(resolve_model(MODEL, allowed_dirs=None))
    return Job(record, QUESTION, shape, "bfloat16", hint)


@pytest.mark.parametrize("producer_in_a_batch", [True, False])
def test_a_question_whose_prefix_is_being_prefilled_joins_that_prefills_batch(
    dispatcher, producer_in_a_batch
):
    """The question would wait for its document's prefill. Where that prefill runs in a batch
    group, it joins that group (not another with a free row): the group prefills its joiners
    in turn, so the question starts from the document's row while it is still there."""
    owner = owner_in(dispatcher, "prefill")
    busy_single(dispatcher, "g0", "other-document")
    busy_single(dispatcher, "g1", owner if producer_in_a_batch else "another-document")
    hint = PrefixHint(pending_job=owner, pending_tokens=len(DOCUMENT))
    question = queued_question(dispatcher, "question", hint)
    assert wait_for_pending(hint, len(QUESTION)) is not None
    cluster = dispatcher.read_cluster(question.record)

    joined = dispatcher.try_join(question, cluster)

    if producer_in_a_batch:
        assert joined is not None
        assert dispatcher.warm.batch("warm-g1") == sorted([owner, "question"])
        assert dispatcher.warm.batch("warm-g0") == ["other-document"]
    else:  # no batch to join behind the prefill: it waits, as plan_admission says
        assert joined is None
        assert dispatcher.warm.batch("warm-g0") == ["other-document"]
        assert dispatcher.warm.batch("warm-g1") == ["another-document"]
