"""Batches: the requests of one JSONL file enqueued together and followed as one.

A batch is a JSON BatchRecord in Redis; each request is an ordinary job whose id is
`{batch id}-{line number}`, so `ringq status` and `ringq result` work on it too. Status and
results read only the jobs' small fields, in one pipelined round trip.

Results follow the OpenAI Batch output format, in input order; failed and cancelled requests
become error lines. A prefill job's line has an empty assistant message and its prompt token
count in `usage`."""

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from jobs import keys
from jobs.batch_input import BatchItem
from jobs.cancel import cancel_many
from jobs.errors import InvalidJobError, JobNotFoundError
from jobs.lifecycle import JobState
from jobs.schemas import (
    BatchEntry,
    BatchRecord,
    JobKind,
    JobResult,
    SkippedLine,
    check_job_id,
)
from jobs.settings import Settings
from jobs.store import JobStore
from jobs.submit import enqueue_jobs


@dataclass(frozen=True)
class BatchCounts:
    """How many of a batch's jobs are in each kind of state; `expired`: records gone from Redis."""

    total: int
    queued: int = 0
    running: int = 0  # admitted, loading, prefill or decode
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    expired: int = 0

    @property
    def done(self) -> int:
        return self.completed + self.failed + self.cancelled + self.expired

    @property
    def is_done(self) -> bool:
        return self.done == self.total


@dataclass(frozen=True)
class BatchResults:
    outputs: list[dict[str, Any]]  # OpenAI output lines of finished requests, input order
    errors: list[dict[str, Any]]  # error lines: failed, cancelled, expired, then skipped lines
    pending: int  # requests not final yet: no line for them now

    def count(self, code: str) -> int:
        """Error lines of one kind: failed, cancelled, expired or skipped."""
        return sum(1 for line in self.errors if line["error"]["code"] == code)


@dataclass(frozen=True)
class BatchCancel:
    cancelled: int  # had not started: cancelled now
    stopping: int  # running: their ranks stop at the next chunk or decode step
    already_final: int


def new_batch_id() -> str:
    return f"batch-{uuid.uuid4().hex[:12]}"


def submit_batch(
    conn: redis.Redis,
    items: Sequence[BatchItem],
    input_name: str,
    skipped_lines: int = 0,
    batch_id: str | None = None,
    skipped: Sequence[SkippedLine] = (),
    settings: Settings | None = None,
) -> BatchRecord:
    """Record the batch (claiming its id), then enqueue its jobs with a few pipelines.
    `skipped`: the invalid lines left out, kept for the errors file. `settings`: the caller's
    (jobs.submit.enqueue_jobs)."""
    batch_id = _checked_id(batch_id or new_batch_id())
    if not items:
        raise InvalidJobError(f"{input_name}: no requests to enqueue")
    entries = [_entry(batch_id, item) for item in items]
    record = BatchRecord(
        id=batch_id,
        created_at=time.time(),
        input_name=input_name,
        entries=entries,
        skipped_lines=max(skipped_lines, len(skipped)),
        skipped=list(skipped),
    )
    ttl_s = JobStore(conn).job_ttl_s
    if not conn.set(keys.batch(batch_id), record.model_dump_json(), nx=True, ex=ttl_s):
        raise InvalidJobError(f"a batch with id {batch_id!r} already exists; choose another id")
    conn.zadd(keys.BATCHES_INDEX, {batch_id: record.created_at})
    jobs = [(entry.job_id, item.spec) for entry, item in zip(entries, items, strict=True)]
    enqueue_jobs(conn, jobs, settings=settings)
    return record


def get_batch(conn: redis.Redis, batch_id: str) -> BatchRecord:
    raw = conn.get(keys.batch(batch_id))
    if raw is None:
        raise JobNotFoundError(f"no batch {batch_id!r} (it never existed or its record expired)")
    return BatchRecord.model_validate_json(raw)


def job_states(conn: redis.Redis, record: BatchRecord) -> list[JobState | None]:
    """Each job's state in input order (None: its record expired), in one round trip."""
    with conn.pipeline(transaction=False) as pipe:
        for entry in record.entries:
            pipe.hget(keys.job(entry.job_id), "state")
        raw_states = pipe.execute()
    return [None if raw is None else JobState(json.loads(raw)) for raw in raw_states]


def batch_counts(conn: redis.Redis, record: BatchRecord) -> BatchCounts:
    return count_states(job_states(conn, record))


def count_states(states: Sequence[JobState | None]) -> BatchCounts:
    counts = dict.fromkeys(("queued", "running", "completed", "failed", "cancelled", "expired"), 0)
    for state in states:
        counts[_bucket(state)] += 1
    return BatchCounts(total=len(states), **counts)


def batch_results(conn: redis.Redis, batch_id: str) -> BatchResults:
    """Output and error lines of the requests that are final now, in input order."""
    record = get_batch(conn, batch_id)
    fields = ("state", "kind", "result", "error", "updated_at")
    with conn.pipeline(transaction=False) as pipe:
        for entry in record.entries:
            pipe.hmget(keys.job(entry.job_id), fields)
        rows = pipe.execute()
    outputs: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    pending = 0
    for entry, row in zip(record.entries, rows, strict=True):
        if row[0] is None:
            errors.append(error_line(entry, "expired", "the job's record expired from Redis"))
            continue
        state, kind, result, error, updated_at = (json.loads(value) for value in row)
        if state == JobState.FINISHED:
            outputs.append(
                output_line(entry, JobKind(kind), JobResult.model_validate(result), updated_at)
            )
        elif JobState(state).is_final:
            errors.append(error_line(entry, state, error or state))
        else:
            pending += 1
    errors += [skipped_line(line) for line in record.skipped]
    return BatchResults(outputs, errors, pending)


def cancel_batch(conn: redis.Redis, batch_id: str) -> BatchCancel:
    """Cancel every job of the batch that is not final (jobs/cancel.py, in bulk)."""
    record = get_batch(conn, batch_id)
    job_ids = [entry.job_id for entry in record.entries]
    cancelled, stopping, already_final = cancel_many(conn, job_ids, JobStore(conn).job_ttl_s)
    return BatchCancel(cancelled, stopping, already_final)


def output_line(
    entry: BatchEntry, kind: JobKind, result: JobResult, finished_at: float
) -> dict[str, Any]:
    """One OpenAI Batch output line (a chat.completion body) for a finished job; its usage
    says, as OpenAI's does, how many prompt tokens came from a kept KV cache."""
    generated = result.generated_tokens
    hit_limit = kind == JobKind.GENERATE and generated >= entry.max_tokens
    body = {
        "id": f"chatcmpl-{entry.job_id}",
        "object": "chat.completion",
        "created": int(finished_at),
        "model": entry.model,
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": whole_characters(result.text or "", hit_limit),
                },
                "finish_reason": "length" if hit_limit else "stop",
            }
        ],
        "usage": {
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": generated,
            "total_tokens": result.prompt_tokens + generated,
            "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
        },
    }
    response = {"status_code": 200, "request_id": entry.job_id, "body": body}
    return {**_line_head(entry), "response": response, "error": None}


def whole_characters(text: str, cut: bool) -> str:
    """An answer cut at max_tokens ends on a whole character: the last token may hold only the
    first bytes of one, which decode as U+FFFD."""
    return text.rstrip("\ufffd") if cut else text


def error_line(entry: BatchEntry, code: str, message: str) -> dict[str, Any]:
    """One OpenAI Batch error line; `code` is the job's final state (failed, cancelled) or
    expired."""
    return {**_line_head(entry), "response": None, "error": {"code": code, "message": message}}


def skipped_line(line: SkippedLine) -> dict[str, Any]:
    """The error line of an input line left out as invalid (--skip-invalid)."""
    return {
        "id": f"batch_req_line_{line.line_number}",
        "custom_id": line.custom_id,
        "response": None,
        "error": {"code": "skipped", "message": f"line {line.line_number}: {line.message}"},
    }


def _line_head(entry: BatchEntry) -> dict[str, Any]:
    return {"id": f"batch_req_{entry.job_id}", "custom_id": entry.custom_id}


def _entry(batch_id: str, item: BatchItem) -> BatchEntry:
    return BatchEntry(
        custom_id=item.custom_id,
        job_id=f"{batch_id}-{item.line_number}",
        model=item.spec.model,
        max_tokens=item.spec.max_tokens,
    )


def _bucket(state: JobState | None) -> str:
    if state is None:
        return "expired"
    if state == JobState.FINISHED:
        return "completed"
    if state in (JobState.QUEUED, JobState.FAILED, JobState.CANCELLED):
        return state.value
    return "running"


def _checked_id(batch_id: str) -> str:
    try:
        check_job_id(f"{batch_id}-1000000")  # its jobs' ids append "-<line number>"
    except ValueError:
        raise InvalidJobError(
            f"invalid batch id {batch_id!r}: use 1-56 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        ) from None
    return batch_id
