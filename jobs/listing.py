"""Listing jobs and batches, newest first, without scanning every job.

Each state has a sorted set of its jobs (`keys.jobs_in_state`), changed in the same transaction
as the job's state, so listing one state reads only that state's ids. A listing reads only each
job's small fields (never its spec, which holds the whole document; `summary` holds what a
listing shows of it). Ids whose record expired are dropped as they are met."""

import json
import time
from collections.abc import Sequence
from typing import Any

import redis
from pydantic import BaseModel, ConfigDict

from jobs import keys
from jobs.errors import InvalidJobError
from jobs.lifecycle import JobState
from jobs.schemas import BatchRecord, JobHeader, Progress, header_fields
from jobs.store import SUMMARY_FIELD

DEFAULT_LIMIT = 50
MAX_LIMIT = 10_000
_FIELDS = (*header_fields(JobHeader), SUMMARY_FIELD)


class JobSummary(JobHeader):
    """One row of a job list: what `ringq jobs` shows, without the document."""

    model: str | None = None  # None for jobs recorded before summaries were kept
    document_name: str | None = None
    custom_id: str | None = None
    max_tokens: int | None = None


class BatchSummary(BaseModel):
    """One row of a batch list; counts come from jobs.batch.batch_counts when wanted."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str
    created_at: float
    input_name: str
    requests: int
    skipped_lines: int = 0


def eta_s(progress: Progress) -> float | None:
    """Seconds left in the current phase at its current speed: prefill's prompt tokens, or
    decode's tokens up to max_tokens (at most that: EOS may end it sooner); None when there is
    no speed to go by. A prefill's own ETA (by the prompt's FLOPs, from its rank) counts down
    from when it was reported."""
    if progress.phase == JobState.PREFILL and progress.eta_s is not None:
        return max(progress.eta_s - max(time.time() - progress.updated_at, 0.0), 0.0)
    if progress.phase == JobState.PREFILL and progress.prompt_tps > 0:
        return max(progress.total - progress.processed, 0) / progress.prompt_tps
    if progress.phase == JobState.DECODE and progress.generation_tps > 0:
        return max(progress.total - progress.processed, 0) / progress.generation_tps
    return None


def list_jobs(
    conn: redis.Redis,
    state: JobState | str | None = None,
    batch_id: str | None = None,
    limit: int = DEFAULT_LIMIT,
) -> list[JobSummary]:
    """The newest `limit` jobs, of one state and/or one batch when given."""
    limit = _checked_limit(limit)
    wanted = _checked_state(state)
    if batch_id is not None:
        return _batch_jobs(conn, batch_id, wanted, limit)
    ensure_state_indexes(conn)
    index = keys.JOBS_INDEX if wanted is None else keys.jobs_in_state(wanted)
    found: list[JobSummary] = []
    start = 0
    while len(found) < limit:
        ids = [_text(i) for i in conn.zrevrange(index, start, start + limit - 1)]
        if not ids:
            break
        found += summaries(conn, ids, wanted, index)
        start += len(ids)
    return found[:limit]


def list_batches(conn: redis.Redis, limit: int = DEFAULT_LIMIT) -> list[BatchSummary]:
    """The newest `limit` batches (their records only; jobs.batch.batch_counts counts them)."""
    limit = _checked_limit(limit)
    ids = [_text(i) for i in conn.zrevrange(keys.BATCHES_INDEX, 0, limit - 1)]
    raws = conn.mget([keys.batch(i) for i in ids]) if ids else []
    gone = [i for i, raw in zip(ids, raws, strict=True) if raw is None]
    if gone:
        conn.zrem(keys.BATCHES_INDEX, *gone)
    return [_batch_summary(BatchRecord.model_validate_json(raw)) for raw in raws if raw]


def ensure_state_indexes(conn: redis.Redis, chunk_jobs: int = 1000) -> None:
    """Index the jobs recorded before per-state indexes existed (once per Redis). A job whose
    state changes meanwhile may stay in an old state's index: listings check each job's
    state, so such an entry is skipped (and removed) when met."""
    if conn.exists(keys.STATE_INDEXES_READY):
        return
    start = 0
    while ids := [_text(i) for i in conn.zrange(keys.JOBS_INDEX, start, start + chunk_jobs - 1)]:
        with conn.pipeline(transaction=False) as pipe:
            for job_id in ids:
                pipe.hmget(keys.job(job_id), ["state", "created_at"])
            rows = pipe.execute()
        with conn.pipeline(transaction=False) as pipe:
            for job_id, (state, created) in zip(ids, rows, strict=True):
                if state is not None:
                    pipe.zadd(keys.jobs_in_state(json.loads(state)), {job_id: json.loads(created)})
            pipe.execute()
        start += chunk_jobs
    conn.set(keys.STATE_INDEXES_READY, "1")


def summaries(
    conn: redis.Redis, ids: Sequence[str], wanted: JobState | None, index: str | None = None
) -> list[JobSummary]:
    """Summaries of `ids` in order, one round trip; drops expired ids (and stale index
    entries) from `index`."""
    with conn.pipeline(transaction=False) as pipe:
        for job_id in ids:
            pipe.hmget(keys.job(job_id), _FIELDS)
        rows = pipe.execute()
    found, dropped = [], []
    for job_id, row in zip(ids, rows, strict=True):
        summary = _summary(job_id, row)
        if summary is None or (wanted is not None and summary.state != wanted):
            dropped.append(job_id)
        else:
            found.append(summary)
    if dropped and index is not None:
        _drop_stale(conn, index, dropped, wanted)
    return found


def _drop_stale(conn: redis.Redis, index: str, job_ids: list[str], wanted: JobState | None) -> None:
    """Remove index entries of expired jobs, and of jobs no longer in the index's state. The
    state is read again inside a transaction, so a job that just moved back is kept."""
    for job_id in job_ids:
        with conn.pipeline() as pipe:
            try:
                pipe.watch(keys.job(job_id))
                raw = pipe.hget(keys.job(job_id), "state")
                if raw is not None and (wanted is None or json.loads(raw) == wanted):
                    continue
                pipe.multi()
                pipe.zrem(index, job_id)
                pipe.execute()
            except redis.WatchError:
                continue


def _summary(job_id: str, row: list[Any]) -> JobSummary | None:
    if row[1] is None:  # no state: the record expired
        return None
    fields = {name: json.loads(v) for name, v in zip(_FIELDS, row, strict=True) if v is not None}
    extra = fields.pop(SUMMARY_FIELD, None) or {}
    return JobSummary.model_validate({"id": job_id, **fields, **extra})


def _batch_jobs(
    conn: redis.Redis, batch_id: str, wanted: JobState | None, limit: int
) -> list[JobSummary]:
    from jobs.batch import get_batch  # jobs.batch imports the submit path (rq)

    record = get_batch(conn, batch_id)
    ids = [entry.job_id for entry in record.entries]  # input order
    found: list[JobSummary] = []
    for start in range(0, len(ids), max(limit, 100)):
        found += summaries(conn, ids[start : start + max(limit, 100)], wanted, None)
        if len(found) >= limit:
            break
    return found[:limit]


def _batch_summary(record: BatchRecord) -> BatchSummary:
    return BatchSummary(
        id=record.id,
        created_at=record.created_at,
        input_name=record.input_name,
        requests=len(record.entries),
        skipped_lines=record.skipped_lines,
    )


def _checked_state(state: JobState | str | None) -> JobState | None:
    if state is None:
        return None
    try:
        return JobState(state)
    except ValueError:
        names = ", ".join(s.value for s in JobState)
        raise InvalidJobError(f"no state {state!r}; states: {names}") from None


def _checked_limit(limit: int) -> int:
    if not 1 <= limit <= MAX_LIMIT:
        raise InvalidJobError(f"limit {limit} is not between 1 and {MAX_LIMIT}")
    return limit


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
