"""Listing jobs and batches from the per-state indexes, against a real redis-server."""

import pytest

from jobs import keys
from jobs.batch import submit_batch
from jobs.batch_input import BatchItem
from jobs.cancel import cancel_job, cancel_many
from jobs.errors import InvalidJobError
from jobs.lifecycle import JobState
from jobs.listing import ensure_state_indexes, list_batches, list_jobs
from jobs.schemas import JobKind, JobSpec, SkippedLine
from jobs.store import JobStore

MODEL = "random:tiny-llama"  # nothing to read: submit checks it at once


def spec(name: str = "doc.txt", **fields) -> JobSpec:
    return JobSpec(
        kind=JobKind.PREFILL, document="hello", document_name=name, model=MODEL, **fields
    )


@pytest.fixture
def store(redis_conn):
    return JobStore(redis_conn)


def index(conn, state: JobState) -> list[str]:
    return [i.decode() for i in conn.zrange(keys.jobs_in_state(state), 0, -1)]


def test_each_state_change_moves_the_job_between_state_indexes(redis_conn, store):
    store.create("a", spec())
    store.create("b", spec())
    assert index(redis_conn, JobState.QUEUED) == ["a", "b"]
    store.transition("a", JobState.ADMITTED)
    store.transition("a", JobState.LOADING)
    assert index(redis_conn, JobState.QUEUED) == ["b"]
    assert index(redis_conn, JobState.ADMITTED) == []
    assert index(redis_conn, JobState.LOADING) == ["a"]
    cancel_job(store, "b")
    assert index(redis_conn, JobState.QUEUED) == []
    assert index(redis_conn, JobState.CANCELLED) == ["b"]
    created = store.get("b").created_at
    assert redis_conn.zscore(keys.jobs_in_state(JobState.CANCELLED), "b") == created


def test_cancel_in_bulk_keeps_the_indexes(redis_conn, store):
    for job_id in ("q1", "q2", "run"):
        store.create(job_id, spec())
    store.transition("q2", JobState.ADMITTED)
    store.transition("run", JobState.ADMITTED)
    store.transition("run", JobState.LOADING)
    assert cancel_many(redis_conn, ["q1", "q2", "run"], ttl_s=60) == (2, 1, 0)
    assert index(redis_conn, JobState.CANCELLED) == ["q1", "q2"]
    assert index(redis_conn, JobState.QUEUED) == index(redis_conn, JobState.ADMITTED) == []
    assert index(redis_conn, JobState.LOADING) == ["run"]  # its ranks end it


def test_list_is_newest_first_filtered_and_limited(redis_conn, store):
    for n in range(5):
        store.create(f"j{n}", spec(name=f"doc{n}.txt", custom_id=f"c{n}"))
    store.transition("j1", JobState.ADMITTED)
    store.fail("j3", "broken")
    assert [j.id for j in list_jobs(redis_conn)] == ["j4", "j3", "j2", "j1", "j0"]
    assert [j.id for j in list_jobs(redis_conn, state="queued")] == ["j4", "j2", "j0"]
    assert [j.id for j in list_jobs(redis_conn, state=JobState.QUEUED, limit=2)] == ["j4", "j2"]
    [failed] = list_jobs(redis_conn, state="failed")
    assert (failed.id, failed.error, failed.model) == ("j3", "broken", MODEL)
    assert (failed.document_name, failed.custom_id) == ("doc3.txt", "c3")


def test_expired_jobs_leave_the_list_and_the_index(redis_conn, store):
    store.create("gone", spec())
    store.create("kept", spec())
    redis_conn.delete(keys.job("gone"))
    assert [j.id for j in list_jobs(redis_conn, state="queued")] == ["kept"]
    assert index(redis_conn, JobState.QUEUED) == ["kept"]


def test_jobs_recorded_before_the_indexes_are_indexed_once(redis_conn, store):
    store.create("old1", spec())
    store.create("old2", spec())
    store.transition("old2", JobState.ADMITTED)
    redis_conn.delete(keys.jobs_in_state(JobState.QUEUED), keys.jobs_in_state(JobState.ADMITTED))
    redis_conn.delete(keys.STATE_INDEXES_READY)
    assert [j.id for j in list_jobs(redis_conn, state="admitted")] == ["old2"]
    assert index(redis_conn, JobState.QUEUED) == ["old1"]
    redis_conn.delete(keys.jobs_in_state(JobState.QUEUED))
    ensure_state_indexes(redis_conn)  # done already: not again
    assert index(redis_conn, JobState.QUEUED) == []


def test_a_stale_index_entry_is_skipped_and_removed(redis_conn, store):
    store.create("j", spec())
    store.transition("j", JobState.ADMITTED)
    redis_conn.zadd(keys.jobs_in_state(JobState.QUEUED), {"j": 1.0})  # as a racing rebuild might
    assert list_jobs(redis_conn, state="queued") == []
    assert index(redis_conn, JobState.QUEUED) == []


def test_bad_state_and_limit_are_refused(redis_conn):
    with pytest.raises(InvalidJobError, match="no state 'done'; states: queued"):
        list_jobs(redis_conn, state="done")
    with pytest.raises(InvalidJobError, match="limit 0"):
        list_jobs(redis_conn, limit=0)


def test_batches_are_listed_newest_first_and_their_jobs_in_input_order(redis_conn):
    items = [BatchItem(n, f"c{n}", spec(custom_id=f"c{n}")) for n in (1, 2, 3)]
    skipped = [SkippedLine(line_number=4, message="invalid JSON")]
    submit_batch(redis_conn, items, "first.jsonl", batch_id="b1")
    submit_batch(redis_conn, items[:1], "second.jsonl", batch_id="b2", skipped=skipped)
    batches = list_batches(redis_conn)
    assert [(b.id, b.requests, b.skipped_lines) for b in batches] == [("b2", 1, 1), ("b1", 3, 0)]
    assert [j.id for j in list_jobs(redis_conn, batch_id="b1")] == ["b1-1", "b1-2", "b1-3"]
    cancel_job(JobStore(redis_conn), "b1-2")
    assert [j.id for j in list_jobs(redis_conn, state="cancelled", batch_id="b1")] == ["b1-2"]
    redis_conn.delete(keys.batch("b2"))
    assert [b.id for b in list_batches(redis_conn)] == ["b1"]
