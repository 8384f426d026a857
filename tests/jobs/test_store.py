"""Job records against a real redis-server."""

import pytest

from jobs.errors import IllegalTransitionError, InvalidJobError, JobNotFoundError
from jobs.lifecycle import JobState
from jobs.schemas import JobKind, JobSpec, Progress
from jobs.store import JobStore

SPEC = JobSpec(kind=JobKind.PREFILL, document="hello world")


@pytest.fixture
def store(redis_conn):
    return JobStore(redis_conn)


def test_create_and_read_back(store):
    created = store.create("j1", SPEC)
    assert store.get("j1") == created
    assert created.state == JobState.QUEUED


def test_duplicate_id_is_rejected_and_the_first_job_kept(store):
    store.create("j1", SPEC)
    with pytest.raises(InvalidJobError, match="already exists"):
        store.create("j1", JobSpec(kind="prefill", document="other"))
    assert store.get("j1").spec.document == "hello world"


def test_transition_writes_fields_atomically(store):
    store.create("j1", SPEC)
    record = store.transition("j1", JobState.ADMITTED, progress=Progress(phase="admitted", total=9))
    assert record.state == JobState.ADMITTED and record.progress.total == 9


def test_illegal_transition_is_refused(store):
    store.create("j1", SPEC)
    with pytest.raises(IllegalTransitionError, match="queued -> decode"):
        store.transition("j1", JobState.DECODE)
    assert store.get("j1").state == JobState.QUEUED


def test_fail_only_once(store):
    store.create("j1", SPEC)
    assert store.fail("j1", "first reason")
    assert not store.fail("j1", "second reason")
    record = store.get("j1")
    assert record.state == JobState.FAILED and record.error == "first reason"


def test_missing_job(store):
    with pytest.raises(JobNotFoundError):
        store.get("nope")
    assert not store.fail("nope", "x")


def test_tokens_round_trip(store):
    store.create("j1", SPEC)
    store.set_tokens("j1", [1, 2, 3])
    assert store.get_tokens("j1") == [1, 2, 3]


@pytest.mark.parametrize("state", [JobState.FAILED, JobState.CANCELLED])
def test_end_moves_a_live_job_to_its_final_state_once(store, state):
    store.create("j1", SPEC)
    assert store.end("j1", state, "why")
    assert not store.end("j1", JobState.FAILED, "again")
    record = store.get("j1")
    assert record.state == record.progress.phase == state and record.error == "why"


def test_end_of_a_stale_group_leaves_the_job_alone(store):
    store.create("j1", SPEC)
    assert not store.end("j1", JobState.FAILED, "stale", group_id="g-old")
    assert store.get("j1").state == JobState.QUEUED


def test_end_refuses_states_that_need_a_result(store):
    store.create("j1", SPEC)
    with pytest.raises(ValueError, match="finished"):
        store.end("j1", JobState.FINISHED, "no result")
