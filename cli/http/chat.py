"""OpenAI's /v1/chat/completions and /v1/models.

A chat completion is one generate job: the messages are flattened the way batch lines are
(jobs/batch_input.py: the last user message is the question, the ones before it the document),
the job is submitted, and the answer comes when it finishes. With `stream: true` the answer is
server-sent events with the text as it is decoded (cli/http/chat_stream.py). A caller that goes
away cancels its job."""

import asyncio
import json
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from cli.http.chat_result import cancel_quietly, completion, raise_unless_finished
from cli.http.chat_stream import stream_completion
from cli.http.deps import Config, Conn
from cli.http.errors import ApiError, error_body
from cli.http.job_views import JobView, read_view, served_models
from cli.http.tenants import Caller, Tenant, own_jobs
from jobs.batch_input import CHAT_COMPLETIONS_URL, Defaults, parse_batch_lines
from jobs.model_info import served_model_info
from jobs.schemas import BatchEntry
from jobs.settings import Settings
from jobs.submit import submit_job

router = APIRouter(prefix="/v1")
POLL_S = 0.1
DEFAULT_MAX_TOKENS = 256


@router.get("/models")
def list_models() -> dict[str, Any]:
    return {"object": "list", "data": [_model(name) for name in served_models()]}


@router.get("/models/{model_id:path}")
def retrieve_model(model_id: str, settings: Config) -> dict[str, Any]:
    served_model_info(model_id, settings)  # the one model rule (jobs/model_rule.py)
    return _model(model_id)


@router.post("/chat/completions")
async def chat_completions(request: Request, conn: Conn, settings: Config, tenant: Caller) -> Any:
    body = await _json_object(request)
    stream = bool(body.pop("stream", False))
    options = body.pop("stream_options", None) or {}
    entry = await run_in_threadpool(_submit, conn, settings, tenant, body)
    if stream:
        events = stream_completion(conn, entry, bool(options.get("include_usage")))
        return StreamingResponse(events, media_type="text/event-stream", headers=_job_header(entry))
    view = await _wait(request, conn, entry.job_id)
    if view is None:  # the caller went away; its job was cancelled
        return JSONResponse(error_body("client closed the request", "invalid_request_error"), 499)
    raise_unless_finished(view)
    return JSONResponse(completion(entry, view), headers=_job_header(entry))


def _submit(conn: Conn, settings: Settings, tenant: Tenant, body: dict[str, Any]) -> BatchEntry:
    """The request as a batch line, checked the same way; its job enqueued, the tenant's."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "model is required: a ringq model name", param="model")
    served_model_info(model, settings)  # not served: a 404, as OpenAI says
    line = {"custom_id": "chat", "method": "POST", "url": CHAT_COMPLETIONS_URL, "body": body}
    defaults = Defaults.of(settings, None, DEFAULT_MAX_TOKENS)
    parsed = parse_batch_lines([json.dumps(line)], Path("."), "chat", defaults, settings)
    if parsed.errors:
        error = parsed.errors[0]
        param = error.param or param_of(error.message)
        raise ApiError(400, error.message, param=param, code="invalid_value")
    spec = parsed.items[0].spec.model_copy(update={"custom_id": None, "document_name": "chat"})
    record = submit_job(conn, spec, settings=settings)
    own_jobs(conn, tenant, [record.id], settings.job_ttl_s)
    return BatchEntry(custom_id="chat", job_id=record.id, model=model, max_tokens=spec.max_tokens)


def param_of(message: str) -> str:
    """The request field a line error names ('body.max_tokens: ...' -> 'max_tokens');
    'messages' for what the messages make (the document, the question)."""
    where, colon, _ = message.partition(":")
    if not colon or " " in where:
        return "messages"
    return where.removeprefix("body.").split(".")[0] or "messages"


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
            await run_in_threadpool(cancel_quietly, conn, job_id)
            return None
        await asyncio.sleep(POLL_S)


def _job_header(entry: BatchEntry) -> dict[str, str]:
    return {"x-ringq-job-id": entry.job_id}


def _model(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "ringq"}
