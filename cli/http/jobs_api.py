"""ringq's own job endpoints: submit, list, status, a progress stream (SSE), cancel.

POST /api/jobs                  {"kind", "document", "prompt"?, "model"?, ...JobSpec, "id"?}
GET  /api/jobs?state=&batch=&limit=
GET  /api/jobs/{id}             the job without its document (+ spec, result)
GET  /api/jobs/{id}/events      SSE: `progress` events while it runs, `text` while it decodes
                                (the new generated text), then one `end`
POST /api/jobs/{id}/cancel
"""

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from cli.http.deps import Config, Conn
from cli.http.errors import ApiError
from cli.http.job_views import JobView, read_view, spec_json
from cli.http.tenants import Caller, check_batch, check_job, own_jobs, tenant_jobs
from jobs import keys
from jobs.cancel import cancel_job
from jobs.job_text import TextFollower, read_text
from jobs.lifecycle import JobState
from jobs.listing import MAX_LIMIT, eta_s, list_jobs
from jobs.schemas import JobSpec, TrackedGroup
from jobs.store import JobStore
from jobs.submit import submit_job

router = APIRouter(prefix="/api/jobs")
POLL_S = 0.25
KEEPALIVE_S = 10.0


@router.post("", status_code=201)
def submit(body: dict[str, Any], conn: Conn, settings: Config, tenant: Caller) -> dict[str, Any]:
    job_id = body.pop("id", None)
    if job_id is not None and not isinstance(job_id, str):
        raise ApiError(400, "id must be a string", param="id")
    body.setdefault("model", settings.default_model)
    spec = JobSpec.model_validate(body)
    record = submit_job(conn, spec, job_id, settings)  # the one model rule, in check_spec
    own_jobs(conn, tenant, [record.id], settings.job_ttl_s)
    return view_json(read_view(conn, record.id))


@router.get("")
def list_(
    conn: Conn,
    tenant: Caller,
    state: JobState | None = None,
    batch: str | None = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIMIT)] = 50,
) -> dict[str, Any]:
    if batch is not None:
        check_batch(conn, tenant, batch)
    if tenant.id is not None and not tenant.admin and batch is None:
        rows = tenant_jobs(conn, tenant.id, state, limit)
    else:
        rows = list_jobs(conn, state=state, batch_id=batch, limit=limit)
    data = [{**row.model_dump(mode="json"), "eta_s": eta_s(row.progress)} for row in rows]
    return {"object": "list", "data": data}


@router.get("/{job_id}")
def status(job_id: str, conn: Conn, tenant: Caller) -> dict[str, Any]:
    check_job(conn, tenant, job_id)
    record = JobStore(conn).get(job_id)
    view = read_view(conn, job_id)
    return {
        **view_json(view),
        "spec": spec_json(record),
        "retry_reasons": record.retry_reasons,
        "admitted_at": admitted_at(conn, view),
    }


@router.post("/{job_id}/cancel")
def cancel(job_id: str, conn: Conn, tenant: Caller) -> dict[str, Any]:
    check_job(conn, tenant, job_id)
    cancel_job(JobStore(conn), job_id)
    return view_json(read_view(conn, job_id))


@router.get("/{job_id}/events")
async def events(job_id: str, request: Request, conn: Conn, tenant: Caller) -> StreamingResponse:
    await run_in_threadpool(check_job, conn, tenant, job_id)
    first = await run_in_threadpool(read_view, conn, job_id)  # a 404 before the stream starts
    return StreamingResponse(
        progress_events(conn, first),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def progress_events(conn: Conn, view: JobView) -> AsyncIterator[str]:
    """`event: progress` with the job's view whenever it changes, `event: text` {"text"} with
    the text generated since the last one (jobs/job_text.py), `event: end` with its final view;
    a comment every KEEPALIVE_S keeps idle connections open."""
    last: JobView | None = None
    quiet_s = 0.0
    follower, after_id = TextFollower(), "0"
    while True:
        deltas, after_id = await run_in_threadpool(read_text, conn, view.id, after_id)
        for delta in deltas:
            if text := follower.take(delta):
                yield sse("text", {"text": text})
        if view.state.is_final:
            yield sse("end", view_json(view))
            return
        if last is None or (view.state, view.progress) != (last.state, last.progress):
            yield sse("progress", view_json(view))
            last, quiet_s = view, 0.0
        elif quiet_s >= KEEPALIVE_S:
            yield ": keep-alive\n\n"
            quiet_s = 0.0
        await asyncio.sleep(POLL_S)
        quiet_s += POLL_S
        view = await run_in_threadpool(read_view, conn, view.id)


def admitted_at(conn: Conn, view: JobView) -> float | None:
    """When the job's group was admitted, while the group still runs this job (the dispatcher
    tracks running groups; a warm group's entry names the job it runs now)."""
    if view.placement is None:
        return None
    raw = conn.hget(keys.GROUPS_INDEX, view.placement.group_id)
    entry = TrackedGroup.model_validate_json(raw) if raw else None
    if entry is None or entry.group.job_id != view.id:
        return None
    return entry.admitted_at


def sse(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def view_json(view: JobView) -> dict[str, Any]:
    return view.model_dump(mode="json")
