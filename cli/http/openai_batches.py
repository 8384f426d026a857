"""OpenAI's /v1/batches: create (from an uploaded input file), retrieve, list, cancel.

Create answers at once with status "validating"; the input is checked in the background
(resolving a GGUF model takes seconds), then its requests are spooled under RINGQ_HOME and fed
to the queue RINGQ_BATCH_WINDOW jobs at a time (jobs/batch_feed.py). Every line must be valid,
as with OpenAI: one bad line fails the batch, and `errors` names the lines. OpenAI model names
("gpt-4o-mini") run where RINGQ_MODEL_ALIASES maps them, or with `metadata={"model":
"smollm2"}`, which runs every line on that model; otherwise one error says so for the whole
batch. A batch belongs to the tenant that created it (cli/http/tenants.py)."""

import logging
import time
from pathlib import Path
from typing import Annotated, Any

import redis
from fastapi import APIRouter, BackgroundTasks, Query
from pydantic import BaseModel, ConfigDict, Field

from cli.http.batch_objects import (
    LineErrorObject,
    OpenAIBatchRecord,
    batch_object,
    cancel_if_asked,
    change,
    load,
    save,
)
from cli.http.deps import Config, Conn, Feeder
from cli.http.errors import ApiError
from cli.http.file_store import FileStore
from cli.http.openai_files import page
from cli.http.tenants import Caller, Tenant, own_batch, own_jobs, visible_batch_ids
from jobs import keys
from jobs.batch import new_batch_id
from jobs.batch_feed import BatchFeeder, start_feed
from jobs.batch_input import (
    CHAT_COMPLETIONS_URL,
    LISTED_ERRORS,
    Defaults,
    ParsedBatch,
    parse_batch_lines,
)
from jobs.errors import JobNotFoundError, RingqError

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/batches")
DEFAULT_MAX_TOKENS = 256  # for lines that give none, as `ringq batch submit`
MODEL_ERROR = (
    "line(s) {lines} name models that are not served here ({names}): create the batch with "
    "metadata={{'model': 'smollm2'}} to run every line on one served model, or ask the operator "
    "to map the names with RINGQ_MODEL_ALIASES (e.g. gpt-4o-mini=smollm2)"
)


class CreateBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = None
    output_expires_after: dict[str, Any] | None = None  # accepted; files expire with the jobs


@router.post("")
def create(
    body: CreateBatch,
    conn: Conn,
    settings: Config,
    tenant: Caller,
    feeder: Feeder,
    background: BackgroundTasks,
) -> dict[str, Any]:
    if body.endpoint != CHAT_COMPLETIONS_URL:
        raise ApiError(
            400,
            f"endpoint {body.endpoint!r} is not supported: ringq batches run "
            f"{CHAT_COMPLETIONS_URL}",
            param="endpoint",
            code="invalid_value",
        )
    if body.completion_window != "24h":
        raise ApiError(
            400, "completion_window must be '24h'", param="completion_window", code="invalid_value"
        )
    input_file = FileStore(conn, settings).get(body.input_file_id, tenant)
    if input_file.purpose != "batch":
        raise ApiError(
            400,
            f"file {input_file.id} has purpose {input_file.purpose!r}, not 'batch'",
            param="input_file_id",
        )
    record = OpenAIBatchRecord(
        id=new_batch_id(),
        endpoint=body.endpoint,
        input_file_id=body.input_file_id,
        completion_window=body.completion_window,
        created_at=int(time.time()),
        metadata=body.metadata,
        owner=tenant.id,
    )
    save(conn, record, settings.job_ttl_s)
    own_batch(conn, tenant, record.id, settings.job_ttl_s)
    background.add_task(validate_and_enqueue, feeder, record)
    return batch_object(conn, record, settings)


@router.get("")
def list_batches(
    conn: Conn,
    settings: Config,
    tenant: Caller,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: str | None = None,
) -> dict[str, Any]:
    ids = [_text(i) for i in conn.zrange(keys.OPENAI_BATCHES_INDEX, 0, -1, desc=True)]
    ids = visible_batch_ids(conn, tenant, ids)
    if after is not None and after in ids:
        ids = ids[ids.index(after) + 1 :]
    found: list[dict[str, Any]] = []
    for batch_id in ids:
        try:
            found.append(batch_object(conn, load(conn, batch_id), settings))
        except RingqError:  # expired meanwhile
            conn.zrem(keys.OPENAI_BATCHES_INDEX, batch_id)
        if len(found) > limit:
            break
    return page(found[:limit], len(found) > limit)


@router.get("/{batch_id}")
def retrieve(batch_id: str, conn: Conn, settings: Config, tenant: Caller) -> dict[str, Any]:
    return batch_object(conn, load_for(conn, tenant, batch_id), settings)


@router.post("/{batch_id}/cancel")
def cancel(batch_id: str, conn: Conn, settings: Config, tenant: Caller) -> dict[str, Any]:
    load_for(conn, tenant, batch_id)
    now = int(time.time())

    def ask(record: OpenAIBatchRecord) -> dict[str, Any] | None:
        if record.stored in ("failed", "completed", "cancelled") or record.cancelling_at:
            return None
        return {"cancelling_at": now}

    record = change(conn, batch_id, settings.job_ttl_s, ask)
    if record.stored in ("failed", "completed", "cancelled"):
        raise ApiError(
            409,
            f"batch {batch_id} is {record.stored}; only a running batch can be cancelled",
            code="batch_not_cancellable",
        )
    cancel_if_asked(conn, record)  # while validating, whoever moves it on cancels its jobs
    return batch_object(conn, record, settings)


def load_for(conn: redis.Redis, tenant: Tenant, batch_id: str) -> OpenAIBatchRecord:
    """The batch's record, if the tenant may see it; else as if there were none."""
    record = load(conn, batch_id)
    if not tenant.sees(record.owner):
        raise JobNotFoundError(f"no batch {batch_id!r} (it never existed or its record expired)")
    return record


def validate_and_enqueue(feeder: BatchFeeder, record: OpenAIBatchRecord) -> None:
    """Check every line of the input file; spool them for the feeder (which enqueues the first
    window at once), or fail the batch naming the bad lines. A cancel that came before the
    batch was recorded wins: no job is enqueued; one that came after cancels its jobs and stops
    its feed."""
    conn, settings = feeder.conn, feeder.settings
    try:
        errors = _enqueue(feeder, record)
    except RingqError as exc:
        errors = [LineErrorObject(code="invalid_file", message=str(exc))]
    except Exception as exc:  # the server outlives any one batch
        log.exception("batch %s: validation failed", record.id)
        errors = [LineErrorObject(code="server_error", message=f"{type(exc).__name__}: {exc}")]
    now = int(time.time())
    enqueued = bool(conn.exists(keys.batch(record.id)))

    def settle(current: OpenAIBatchRecord) -> dict[str, Any] | None:
        if current.stored != "validating":  # a reader moved it on already
            return None
        if errors:
            return {"stored": "failed", "failed_at": now, "errors": errors}
        if current.cancelling_at is not None and not enqueued:
            return {"stored": "cancelled", "cancelled_at": now}
        return {"stored": "in_progress", "in_progress_at": now}

    cancel_if_asked(conn, change(conn, record.id, settings.job_ttl_s, settle))


def _enqueue(feeder: BatchFeeder, record: OpenAIBatchRecord) -> list[LineErrorObject]:
    conn, settings = feeder.conn, feeder.settings
    files = FileStore(conn, settings)
    name = files.get(record.input_file_id).filename
    try:
        text = files.content(record.input_file_id).decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        message = f"not UTF-8 text (byte {exc.start}); a batch file is UTF-8 JSON Lines"
        return [LineErrorObject(code="invalid_file", message=message)]
    model = (record.metadata or {}).get("model")
    defaults = Defaults(
        model,
        settings.default_model,
        DEFAULT_MAX_TOKENS,
        settings.max_document_bytes,
        settings.allowed_dirs or [],  # no server file may be named by a remote caller
    )
    parsed = parse_batch_lines(text.splitlines(), Path("."), name, defaults, settings)
    if parsed.errors:
        return _line_errors(parsed)
    if not parsed.items:
        return [LineErrorObject(code="empty_file", message=f"{name}: no requests")]
    if load(conn, record.id).cancelling_at is None:
        owner = Tenant(record.owner, admin=False)
        batch = start_feed(conn, settings, parsed.items, name, record.id)
        own_jobs(conn, owner, [entry.job_id for entry in batch.entries], settings.job_ttl_s)
        feeder.wake.set()  # its first window now, not at the next poll
    return []


def _line_errors(parsed: ParsedBatch) -> list[LineErrorObject]:
    """One error object a bad line, and one for all the lines naming models that are not
    served here (an OpenAI file's "gpt-4o-mini" on every line), naming what fixes it."""
    model_errors = [e for e in parsed.errors if e.bad_model is not None]
    found = [
        LineErrorObject(code="invalid_request", message=e.message, line=e.line_number)
        for e in parsed.errors
        if e not in model_errors
    ]
    if model_errors:
        names = ", ".join(sorted({repr(e.bad_model) for e in model_errors}))
        lines = ", ".join(str(e.line_number) for e in model_errors[:LISTED_ERRORS])
        more = (
            f" and {len(model_errors) - LISTED_ERRORS} more"
            if len(model_errors) > LISTED_ERRORS
            else ""
        )
        message = MODEL_ERROR.format(lines=lines + more, names=names)
        found.insert(0, LineErrorObject(code="model_not_found", message=message, param="model"))
    return found


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
