"""Batches: the requests of one JSONL file enqueued together and followed as one.

A batch is a JSON BatchRecord in Redis; each request is an ordinary job whose id is
`{batch id}-{line number}`, so `ringq status` and `ringq result` work on it too. Status and
results read only the jobs' small fields, in one pipelined round trip.

A batch created through `ringq serve` is fed in a window (jobs/batch_feed.py): its record lists
every request, but only the lines its Feed says are enqueued have jobs. The others count as
queued, or, once the feed is stopped (a cancel), end in the state it names without a job.

Results follow the OpenAI Batch output format, in input order; failed and cancelled requests
become error lines. A prefill job's line has an empty assistant message and its prompt token
count in `usage`."""

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
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

NOT_ENQUEUED_REASON = "the batch was cancelled before this request was enqueued"


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
class Feed:
    """How far a windowed batch is enqueued (keys.batch_feed): lines 0..enqueued-1 have jobs,
    at most `window` of them unfinished (RINGQ_BATCH_WINDOW of the server that created it). Once
    `stopped`, no further line is enqueued: the others end in that state, for `reason`."""

    total: int
    enqueued: int
    window: int
    stopped: JobState | None = None
    reason: str = ""

    @property
    def waiting_state(self) -> JobState:
        """The state a line that is not enqueued counts as."""
        return self.stopped or JobState.QUEUED

    @property
    def done(self) -> bool:
        """Whether no line is left to enqueue."""
        return self.stopped is not None or self.enqueued >= self.total


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
    """Record the batch (claiming its id), then enqueue all its jobs with a few pipelines (the
    operator's way: `ringq batch submit`, the Python client; jobs/batch_feed.py feeds the
    batches of `ringq serve` in a window). `skipped`: the invalid lines left out, kept for the
    errors file. `settings`: the caller's (jobs.submit.enqueue_jobs)."""
    record = new_batch_record(items, input_name, skipped_lines, batch_id, skipped)
    ttl_s = JobStore(conn).job_ttl_s
    if not conn.set(keys.batch(record.id), record.model_dump_json(), nx=True, ex=ttl_s):
        raise InvalidJobError(f"a batch with id {record.id!r} already exists; choose another id")
    conn.zadd(keys.BATCHES_INDEX, {record.id: record.created_at})
    jobs = [(entry.job_id, item.spec) for entry, item in zip(record.entries, items, strict=True)]
    enqueue_jobs(conn, jobs, settings=settings)
    return record


def new_batch_record(
    items: Sequence[BatchItem],
    input_name: str,
    skipped_lines: int = 0,
    batch_id: str | None = None,
    skipped: Sequence[SkippedLine] = (),
) -> BatchRecord:
    """The record of a new batch of `items` (its id checked, or a new one)."""
    batch_id = _checked_id(batch_id or new_batch_id())
    if not items:
        raise InvalidJobError(f"{input_name}: no requests to enqueue")
    return BatchRecord(
        id=batch_id,
        created_at=time.time(),
        input_name=input_name,
        entries=[_entry(batch_id, item) for item in items],
        skipped_lines=max(skipped_lines, len(skipped)),
        skipped=list(skipped),
    )


def get_batch(conn: redis.Redis, batch_id: str) -> BatchRecord:
    raw = conn.get(keys.batch(batch_id))
    if raw is None:
        raise JobNotFoundError(f"no batch {batch_id!r} (it never existed or its record expired)")
    return BatchRecord.model_validate_json(raw)


def read_feed(conn: redis.Redis, batch_id: str) -> Feed | None:
    """The batch's feed; None for a batch enqueued whole (or whose feed expired)."""
    return parse_feed(conn.hgetall(keys.batch_feed(batch_id)))


def parse_feed(raw: dict[Any, Any]) -> Feed | None:
    fields = {_text(k): _text(v) for k, v in raw.items()}
    if "total" not in fields:
        return None
    stopped = fields.get("stopped")
    return Feed(
        total=int(fields["total"]),
        enqueued=int(fields.get("enqueued", 0)),
        window=int(fields.get("window", 1)),
        stopped=JobState(stopped) if stopped else None,
        reason=fields.get("reason", ""),
    )


def stop_feed(
    conn: redis.Redis, batch_id: str, state: JobState, reason: str
) -> tuple[Feed | None, bool]:
    """Enqueue no further line of the batch: those not enqueued end in `state`. Returns the
    feed as it stands (None: the batch is enqueued whole) and whether this call stopped it. The
    feeders WATCH the feed, so none enqueues a line once this has run."""
    key = keys.batch_feed(batch_id)
    with conn.pipeline() as pipe:
        while True:
            try:
                pipe.watch(key)
                feed = parse_feed(pipe.hgetall(key))
                if feed is None or feed.stopped is not None:
                    pipe.unwatch()
                    return feed, False
                pipe.multi()
                pipe.hset(key, mapping={"stopped": state.value, "reason": reason})
                pipe.execute()
                return replace(feed, stopped=state, reason=reason), True
            except redis.WatchError:
                continue


def job_states(conn: redis.Redis, record: BatchRecord) -> list[JobState | None]:
    """Each job's state in input order (None: its record expired; a line not enqueued yet:
    its feed's waiting state), in one round trip."""
    with conn.pipeline(transaction=False) as pipe:
        pipe.hgetall(keys.batch_feed(record.id))  # first: a line it counts has its job
        for entry in record.entries:
            pipe.hget(keys.job(entry.job_id), "state")
        raw_feed, *raw_states = pipe.execute()
    states = [None if raw is None else JobState(json.loads(raw)) for raw in raw_states]
    feed = parse_feed(raw_feed)
    if feed is None:
        return states
    return [*states[: feed.enqueued], *[feed.waiting_state] * (len(states) - feed.enqueued)]


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
        pipe.hgetall(keys.batch_feed(record.id))
        for entry in record.entries:
            pipe.hmget(keys.job(entry.job_id), fields)
        raw_feed, *rows = pipe.execute()
    feed = parse_feed(raw_feed)
    enqueued = len(rows) if feed is None else feed.enqueued
    outputs: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    pending = 0
    for index, (entry, row) in enumerate(zip(record.entries, rows, strict=True)):
        if feed is not None and index >= enqueued:
            if feed.stopped is None:
                pending += 1
            else:
                errors.append(error_line(entry, feed.stopped.value, feed.reason))
            continue
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
    """Cancel every job of the batch that is not final (jobs/cancel.py, in bulk); a fed batch's
    feed stops first, so its lines not enqueued end cancelled without ever having a job."""
    record = get_batch(conn, batch_id)
    feed, stopped_now = stop_feed(conn, batch_id, JobState.CANCELLED, NOT_ENQUEUED_REASON)
    enqueued = len(record.entries) if feed is None else feed.enqueued
    job_ids = [entry.job_id for entry in record.entries[:enqueued]]
    cancelled, stopping, already_final = cancel_many(conn, job_ids, JobStore(conn).job_ttl_s)
    never_enqueued = len(record.entries) - enqueued
    if stopped_now:
        return BatchCancel(cancelled + never_enqueued, stopping, already_final)
    return BatchCancel(cancelled, stopping, already_final + never_enqueued)


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


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _checked_id(batch_id: str) -> str:
    try:
        check_job_id(f"{batch_id}-1000000")  # its jobs' ids append "-<line number>"
    except ValueError:
        raise InvalidJobError(
            f"invalid batch id {batch_id!r}: use 1-56 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        ) from None
    return batch_id
