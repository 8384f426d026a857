"""OpenAI's /v1/chat/completions and /v1/models.

A chat completion is one generate job: the messages are flattened the way batch lines are
(jobs/batch_input.py: the last user message is the question, the ones before it the document),
the job is submitted, and the answer comes when it finishes. With `stream: true` the answer is
server-sent events as OpenAI sends them: a first chunk with the role, SSE comments with the job's
phase and token count while it runs (clients ignore comments; they keep proxies from closing an
idle connection), the text in chunks, a last chunk with finish_reason, then `data: [DONE]`.
A caller that goes away cancels its job."""

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator
from contextlib import suppress
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from cli.http.deps import Config, Conn
from cli.http.errors import ApiError, error_body
from cli.http.job_views import JobView, check_served_model, read_view, served_models
from jobs.batch import output_line
from jobs.batch_input import CHAT_COMPLETIONS_URL, Defaults, parse_batch_lines
from jobs.cancel import cancel_job
from jobs.errors import RingqError
from jobs.lifecycle import JobState
from jobs.model_catalog import resolve_model
from jobs.schemas import BatchEntry, JobKind
from jobs.settings import Settings
from jobs.submit import submit_job

router = APIRouter(prefix="/v1")
POLL_S = 0.1
KEEPALIVE_S = 5.0
DEFAULT_MAX_TOKENS = 256
_PIECES = re.compile(r"\s*\S+|\s+")  # words with the spaces before them


@router.get("/models")
def list_models() -> dict[str, Any]:
    return {"object": "list", "data": [_model(name) for name in served_models()]}


@router.get("/models/{model_id:path}")
def retrieve_model(model_id: str, settings: Config) -> dict[str, Any]:
    check_served_model(model_id, settings)
    resolve_model(model_id, allowed_dirs=settings.allowed_dirs)
    return _model(model_id)


@router.post("/chat/completions")
async def chat_completions(request: Request, conn: Conn, settings: Config) -> Any:
    body = await _json_object(request)
    stream = bool(body.pop("stream", False))
    options = body.pop("stream_options", None) or {}
    entry = await run_in_threadpool(_submit, conn, settings, body)
    if stream:
        events = _stream(conn, entry, bool(options.get("include_usage")))
        return StreamingResponse(events, media_type="text/event-stream", headers=_job_header(entry))
    view = await _wait(request, conn, entry.job_id)
    if view is None:  # the caller went away; its job was cancelled
        return JSONResponse(error_body("client closed the request", "invalid_request_error"), 499)
    _raise_unless_finished(view)
    return JSONResponse(_completion(entry, view), headers=_job_header(entry))


def _submit(conn: Conn, settings: Settings, body: dict[str, Any]) -> BatchEntry:
    """The request as a batch line, checked the same way; its job enqueued."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "model is required: a ringq model name", param="model")
    check_served_model(model, settings)
    resolve_model(model, allowed_dirs=settings.allowed_dirs)  # unknown: a 404, as OpenAI says
    line = {"custom_id": "chat", "method": "POST", "url": CHAT_COMPLETIONS_URL, "body": body}
    defaults = Defaults(
        None, settings.default_model, DEFAULT_MAX_TOKENS, settings.max_document_bytes
    )
    parsed = parse_batch_lines([json.dumps(line)], Path("."), "chat", defaults)
    if parsed.errors:
        raise ApiError(400, parsed.errors[0].message, param="messages", code="invalid_value")
    spec = parsed.items[0].spec.model_copy(update={"custom_id": None, "document_name": "chat"})
    record = submit_job(conn, spec)
    return BatchEntry(custom_id="chat", job_id=record.id, model=model, max_tokens=spec.max_tokens)


async def _json_object(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        raise ApiError(400, "the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


async def _wait(request: Request, conn: Conn, job_id: str) -> JobView | None:
    """The job's view once it is final; None (and the job cancelled) if the caller left."""
    while True:
        view = await run_in_threadpool(read_view, conn, job_id)
        if view.state.is_final:
            return view
        if await request.is_disconnected():
            await run_in_threadpool(_cancel_quietly, conn, job_id)
            return None
        await asyncio.sleep(POLL_S)


def _cancel_quietly(conn: Conn, job_id: str) -> None:
    with suppress(RingqError):  # it ended meanwhile
        cancel_job(conn, job_id)


def _raise_unless_finished(view: JobView) -> None:
    if view.state == JobState.FINISHED and view.result is not None:
        return
    message = f"job {view.id} {view.state.value}: {view.error or 'no result'}"
    if view.state == JobState.CANCELLED:
        raise ApiError(409, message, code="job_cancelled")
    if view.placement is None:  # refused at admission: the request's own fault
        raise ApiError(400, message, code="job_rejected")
    raise ApiError(500, message, type_="server_error", code="job_failed")


def _completion(entry: BatchEntry, view: JobView) -> dict[str, Any]:
    assert view.result is not None
    line = output_line(entry, JobKind.GENERATE, view.result, view.updated_at)
    return line["response"]["body"]


async def _stream(conn: Conn, entry: BatchEntry, include_usage: bool) -> AsyncIterator[str]:
    created = int(time.time())
    finished = False
    try:
        yield _chunk(entry, created, {"role": "assistant", "content": ""})
        view = None
        async for view in _progress(conn, entry.job_id):
            progress = view.progress
            yield f": {progress.phase.value} {progress.processed}/{progress.total}\n\n"
        assert view is not None
        finished = True
        try:
            _raise_unless_finished(view)
        except ApiError as exc:
            yield _data(error_body(exc.message, exc.type, exc.param, exc.code))
            return
        body = _completion(entry, view)
        for piece in _PIECES.findall(body["choices"][0]["message"]["content"]):
            yield _chunk(entry, created, {"content": piece})
        yield _chunk(entry, created, {}, finish_reason=body["choices"][0]["finish_reason"])
        if include_usage:
            yield _data({**_chunk_head(entry, created), "choices": [], "usage": body["usage"]})
        yield "data: [DONE]\n\n"
    finally:
        if not finished:  # the caller went away mid-job (no await: this task is cancelled)
            _cancel_quietly(conn, entry.job_id)


async def _progress(conn: Conn, job_id: str) -> AsyncIterator[JobView]:
    """The job's view whenever its progress changes (at least every KEEPALIVE_S), ending with
    its final view."""
    last, sent_at = None, 0.0
    while True:
        view = await run_in_threadpool(read_view, conn, job_id)
        now = time.monotonic()
        if view.state.is_final or view.progress != last or now - sent_at >= KEEPALIVE_S:
            last, sent_at = view.progress, now
            yield view
        if view.state.is_final:
            return
        await asyncio.sleep(POLL_S)


def _chunk(
    entry: BatchEntry, created: int, delta: dict[str, Any], finish_reason: str | None = None
) -> str:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    return _data({**_chunk_head(entry, created), "choices": [choice]})


def _chunk_head(entry: BatchEntry, created: int) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{entry.job_id}",
        "object": "chat.completion.chunk",
        "created": created,
        "model": entry.model,
    }


def _data(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _job_header(entry: BatchEntry) -> dict[str, str]:
    return {"x-ringq-job-id": entry.job_id}


def _model(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "ringq"}
