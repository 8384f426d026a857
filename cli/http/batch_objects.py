"""OpenAI batch objects over ringq batches.

An OpenAI batch is a ringq batch (jobs/batch.py, same id, so `ringq batch status` works on it)
plus a small JSON record of what OpenAI's object adds: its input file, endpoint, window, metadata,
the times it changed status and its output and error files. Its status comes from that record
and the ringq batch's job counts:

    validating   the input file is being checked (in the background, after create returns)
    failed       the input file was refused; `errors` says which lines and why
    in_progress  jobs are queued or running
    cancelling   cancel was asked; some jobs are still winding down
    finalizing   every job has ended; the output and error files are being written
    completed    every job ended and the files are written (failed lines are in the error file)
    cancelled    as completed, after a cancel

The first read that finds every job ended writes the files (a Redis lock keeps it to one)."""

import json
import time
from collections.abc import Callable
from typing import Any, Literal

import redis
from pydantic import BaseModel, ConfigDict

from cli.http.file_store import FileStore
from cli.http.tenants import Tenant
from jobs import keys
from jobs.batch import (
    BatchCounts,
    batch_counts,
    batch_results,
    cancel_batch,
    get_batch,
    job_states,
)
from jobs.errors import JobNotFoundError
from jobs.settings import Settings

COMPLETION_WINDOW_S = 24 * 3600
FINALIZE_LOCK_S = 120
VALIDATION_TIMEOUT_S = 600  # a batch still validating after this long was abandoned
Stored = Literal["validating", "in_progress", "failed", "completed", "cancelled"]


class LineErrorObject(BaseModel):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class OpenAIBatchRecord(BaseModel):
    """What an OpenAI batch adds to a ringq batch, as kept in Redis (keys.openai_batch)."""

    model_config = ConfigDict(extra="forbid")

    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    stored: Stored = "validating"
    metadata: dict[str, str] | None = None
    errors: list[LineErrorObject] = []
    in_progress_at: int | None = None
    cancelling_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    cancelled_at: int | None = None
    failed_at: int | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    owner: str | None = None  # the tenant that created it (cli/http/tenants.py)


def save(conn: redis.Redis, record: OpenAIBatchRecord, ttl_s: int) -> None:
    with conn.pipeline() as pipe:
        pipe.set(keys.openai_batch(record.id), record.model_dump_json(), ex=ttl_s)
        # Scored by the first save's time (created_at has whole seconds: batches would tie).
        pipe.zadd(keys.OPENAI_BATCHES_INDEX, {record.id: time.time()}, nx=True)
        pipe.execute()


def change(
    conn: redis.Redis,
    batch_id: str,
    ttl_s: int,
    decide: Callable[[OpenAIBatchRecord], dict[str, Any] | None],
) -> OpenAIBatchRecord:
    """Apply the fields `decide` returns for the current record (None: leave it) in one
    optimistic transaction: the creating thread, a cancel and readers never undo each other."""
    key = keys.openai_batch(batch_id)
    with conn.pipeline() as pipe:
        while True:
            try:
                pipe.watch(key)
                raw = pipe.get(key)
                if raw is None:
                    raise JobNotFoundError(f"no batch {batch_id!r} (its record expired)")
                record = OpenAIBatchRecord.model_validate_json(raw)
                update = decide(record)
                if update is None:
                    pipe.unwatch()
                    return record
                record = record.model_copy(update=update)
                pipe.multi()
                pipe.set(key, record.model_dump_json(), ex=ttl_s)
                pipe.execute()
                return record
            except redis.WatchError:
                continue


def load(conn: redis.Redis, batch_id: str) -> OpenAIBatchRecord:
    raw = conn.get(keys.openai_batch(batch_id))
    if raw is None:
        raise JobNotFoundError(f"no batch {batch_id!r} (it never existed or its record expired)")
    return OpenAIBatchRecord.model_validate_json(raw)


def batch_object(
    conn: redis.Redis, record: OpenAIBatchRecord, settings: Settings
) -> dict[str, Any]:
    """OpenAI's batch object for `record`, finishing the batch first if its jobs all ended."""
    ttl_s = settings.job_ttl_s
    counts = None
    if record.stored == "validating":
        record = _recover_validation(conn, record, ttl_s)
    status: str = record.stored
    if record.stored == "in_progress":
        counts = batch_counts(conn, get_batch(conn, record.id))
        if counts.is_done:
            record = finalize(conn, record, settings)
        status = record.stored
        if status == "in_progress":
            status = _live_status(conn, record, counts)
    elif record.stored == "validating" and record.cancelling_at is not None:
        status = "cancelling"
    elif record.stored in ("completed", "cancelled"):
        counts = _counts_if_kept(conn, record.id)
    return _object(record, status, counts)


def finalize(conn: redis.Redis, record: OpenAIBatchRecord, settings: Settings) -> OpenAIBatchRecord:
    """Write the output and error files (the batch's tenant's) and mark the batch completed (or
    cancelled); returns the record unchanged while another request is doing it."""
    ttl_s = settings.job_ttl_s
    lock = keys.openai_batch_finalizing(record.id)
    if not conn.set(lock, str(time.time()), nx=True, ex=FINALIZE_LOCK_S):
        return record
    try:
        record = load(conn, record.id)  # the holder before us may have finished it
        if record.stored != "in_progress":
            return record
        now = int(time.time())
        found = batch_results(conn, record.id)
        if found.pending:  # not all final after all (counted before a job was written)
            return record
        files, owner = FileStore(conn, settings), Tenant(record.owner, admin=False)
        update: dict[str, Any] = {"finalizing_at": now}
        if found.outputs:
            update["output_file_id"] = files.put(
                f"{record.id}_output.jsonl", "batch_output", _jsonl(found.outputs), owner
            ).id
        if found.errors:
            update["error_file_id"] = files.put(
                f"{record.id}_error.jsonl", "batch_output", _jsonl(found.errors), owner
            ).id

        def finish(current: OpenAIBatchRecord) -> dict[str, Any] | None:
            if current.stored != "in_progress":
                return None
            if current.cancelling_at is not None:
                return update | {"stored": "cancelled", "cancelled_at": now}
            return update | {"stored": "completed", "completed_at": now}

        return change(conn, record.id, ttl_s, finish)
    finally:
        conn.delete(lock)


def _recover_validation(
    conn: redis.Redis, record: OpenAIBatchRecord, ttl_s: int
) -> OpenAIBatchRecord:
    """A batch left `validating` by a server that stopped mid-way: in progress if its jobs were
    enqueued, failed once VALIDATION_TIMEOUT_S has passed without them."""
    now = int(time.time())
    if now - record.created_at <= VALIDATION_TIMEOUT_S and not _all_enqueued(conn, record.id):
        return record  # its jobs may still be being written
    enqueued = bool(conn.exists(keys.batch(record.id)))  # past the wait, track what was written

    def recover(current: OpenAIBatchRecord) -> dict[str, Any] | None:
        if current.stored != "validating":
            return None
        if enqueued:
            return {"stored": "in_progress", "in_progress_at": now}
        message = "validation was interrupted (the server stopped?): create the batch again"
        error = LineErrorObject(code="validation_interrupted", message=message)
        return {"stored": "failed", "failed_at": now, "errors": [error]}

    record = change(conn, record.id, ttl_s, recover)
    cancel_if_asked(conn, record)
    return record


def _all_enqueued(conn: redis.Redis, batch_id: str) -> bool:
    """Whether every job of the batch is written (a fed batch's lines not enqueued yet count
    as queued). The batch's record is claimed before its jobs are written (jobs.batch.
    submit_batch): a reader in between must not take the missing jobs for expired ones and
    finish the batch as failed."""
    try:
        return None not in job_states(conn, get_batch(conn, batch_id))
    except JobNotFoundError:
        return False


def cancel_if_asked(conn: redis.Redis, record: OpenAIBatchRecord) -> None:
    """Cancel the jobs of a batch whose cancel came while it was validating (idempotent)."""
    if record.stored == "in_progress" and record.cancelling_at is not None:
        cancel_batch(conn, record.id)


def request_counts(counts: BatchCounts | None) -> dict[str, int]:
    if counts is None:
        return {"total": 0, "completed": 0, "failed": 0}
    failed = counts.failed + counts.cancelled + counts.expired
    return {"total": counts.total, "completed": counts.completed, "failed": failed}


def _live_status(conn: redis.Redis, record: OpenAIBatchRecord, counts: BatchCounts) -> str:
    if conn.exists(keys.openai_batch_finalizing(record.id)) or counts.is_done:
        return "finalizing"
    return "cancelling" if record.cancelling_at is not None else "in_progress"


def _counts_if_kept(conn: redis.Redis, batch_id: str) -> BatchCounts | None:
    try:
        return batch_counts(conn, get_batch(conn, batch_id))
    except JobNotFoundError:
        return None


def _object(record: OpenAIBatchRecord, status: str, counts: BatchCounts | None) -> dict[str, Any]:
    fields = record.model_dump(mode="json", exclude={"stored", "errors", "owner"})
    errors = [e.model_dump(mode="json") for e in record.errors]
    return {
        **fields,
        "object": "batch",
        "status": status,
        "errors": {"object": "list", "data": errors} if errors else None,
        "expires_at": record.created_at + COMPLETION_WINDOW_S,
        "expired_at": None,
        "request_counts": request_counts(counts),
    }


def _jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines).encode()
