"""Dispatcher.prefix_hint (jobs/dispatcher.py, jobs/prefix_index.py read_hint) in a real Redis:
a later job on the same document waits for a pending-prefix marker only while the job that left
it may still keep its KV; the marker of a job that ended (failed, cancelled, gone, finished past
its grace) holds no one, though it stays in Redis until its TTL."""

import json
import time

import pytest

from jobs import keys
from jobs.admit_plan import Cluster, Job, Place, Wait, plan_admission
from jobs.dispatcher import Dispatcher
from jobs.lifecycle import JobState
from jobs.model_catalog import read_model_shape, resolve_model
from jobs.prefix_cache import BLOCK_TOKENS, PENDING_GRACE_S, PENDING_TTL_S, wait_for_pending
from jobs.prefix_index import PendingPrefixes, model_key
from jobs.schemas import JobKind, JobSpec
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
