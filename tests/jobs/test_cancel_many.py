"""cancel_many's Lua script against a real Redis, for a job in every state: it must sort states
exactly as cancel_job does (final, not started, running), since its state lists are built from
JobState rather than written out."""

import json

from jobs import keys
from jobs.cancel import NOT_STARTED, NOT_STARTED_REASON, cancel_job, cancel_many
from jobs.lifecycle import FINAL_STATES, JobState
from jobs.schemas import JobKind, JobSpec
from jobs.store import JobStore

SPEC = JobSpec(kind=JobKind.PREFILL, document="hello world")


def put_in_state(store: JobStore, job_id: str, state: JobState) -> None:
    store.create(job_id, SPEC)
    store.conn.hset(keys.job(job_id), "state", json.dumps(state.value))


def test_every_state_is_sorted_as_cancel_job_sorts_it(redis_conn):
    store = JobStore(redis_conn)
    for state in JobState:
        put_in_state(store, state.value, state)
    counts = cancel_many(redis_conn, [s.value for s in JobState], ttl_s=60)
    running = set(JobState) - FINAL_STATES - NOT_STARTED
    assert counts == (len(NOT_STARTED), len(running), len(FINAL_STATES))
    for state in JobState:
        record = store.get(state.value)
        flagged = bool(redis_conn.exists(keys.job_cancel(state.value)))
        if state in NOT_STARTED:
            assert record.state == record.progress.phase == JobState.CANCELLED
            assert record.error == NOT_STARTED_REASON and flagged
        else:
            assert record.state == state and record.error is None
            assert flagged == (state in running), state


def test_the_script_and_cancel_job_agree(redis_conn):
    store = JobStore(redis_conn)
    for state in set(JobState) - FINAL_STATES:
        put_in_state(store, f"one-{state.value}", state)
        put_in_state(store, f"many-{state.value}", state)
        cancel_job(store, f"one-{state.value}")
        cancel_many(redis_conn, [f"many-{state.value}"], ttl_s=60)
        one, many = store.get(f"one-{state.value}"), store.get(f"many-{state.value}")
        assert (one.state, one.progress.phase, one.error) == (
            many.state,
            many.progress.phase,
            many.error,
        ), state


def test_a_missing_job_counts_as_final(redis_conn):
    assert cancel_many(redis_conn, ["never-existed"], ttl_s=60) == (0, 0, 1)
