"""Cancelling jobs. A job that has not started ends `cancelled` at once; a running one gets a
flag in Redis that its ranks poll, and they stop together at the next chunk or decode step."""

import time

import redis

from jobs import keys
from jobs.errors import IllegalTransitionError, JobNotFoundError
from jobs.lifecycle import JobState
from jobs.schemas import JobRecord
from jobs.store import JobStore

NOT_STARTED = frozenset({JobState.QUEUED, JobState.ADMITTED})


def cancel_job(conn: redis.Redis, job_id: str) -> JobRecord:
    """Ask a live job to stop; returns its record (`cancelled`, or still running while its ranks
    wind down). The flag is set before any state change, so a rank that sees the job cancelled
    also sees the flag."""
    store = JobStore(conn)
    record = store.get(job_id)
    if record.state.is_final:
        raise IllegalTransitionError(
            f"job {job_id} is already {record.state}; only queued or running jobs can be cancelled"
        )
    conn.set(keys.job_cancel(job_id), str(time.time()), ex=store.job_ttl_s)
    if record.state in NOT_STARTED:
        # The dispatcher skips jobs that are no longer queued; ranks already started for an
        # admitted job see the flag at startup and exit together.
        mark_cancelled(store, job_id, "cancelled before it started")
    return store.get(job_id)


def cancel_requested(conn: redis.Redis, job_id: str) -> bool:
    return bool(conn.exists(keys.job_cancel(job_id)))


def mark_cancelled(store: JobStore, job_id: str, reason: str) -> bool:
    """Move a job to `cancelled` unless it is already final. Returns whether this call did."""
    try:
        record = store.get(job_id)
        progress = record.progress.model_copy(
            update={"phase": JobState.CANCELLED, "updated_at": time.time()}
        )
        store.transition(job_id, JobState.CANCELLED, error=reason, progress=progress)
        return True
    except (IllegalTransitionError, JobNotFoundError):
        return False
