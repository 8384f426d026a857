"""`stream: true` chat completions: server-sent events as OpenAI sends them, the text as the
job decodes it.

First a chunk with the role; while the job waits and prefills, SSE comments with its phase (they
keep proxies from closing an idle connection); during decode a content chunk per delta the lead
rank publishes (jobs/job_text.py); once the job is final, the rest of its result text, a last
chunk with finish_reason, usage if asked, then `data: [DONE]`. A failed or cancelled job ends
with an error event. A caller that goes away cancels its job."""

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import redis
from starlette.concurrency import run_in_threadpool

from cli.http.chat_result import cancel_quietly, completion, raise_unless_finished
from cli.http.deps import Conn
from cli.http.errors import ApiError, error_body
from cli.http.job_views import JobView, read_view
from jobs.errors import RingqError
from jobs.job_text import TextFollower, read_text
from jobs.schemas import BatchEntry

log = logging.getLogger(__name__)
TEXT_WAIT_MS = 200  # one XREAD BLOCK: how long a stream waits for text before it looks at the job
KEEPALIVE_S = 5.0
# A stream's blocking XREAD waits in a thread of this pool, not of the one every route shares
# (anyio's default: 40 threads): 40 open streams would otherwise hold every thread 200 ms at a
# time and queue every other request behind them. A thread waiting on a socket costs no CPU.
STREAM_READERS = anyio.CapacityLimiter(1024)


async def stream_completion(
    conn: Conn, entry: BatchEntry, include_usage: bool
) -> AsyncIterator[str]:
    created = int(time.time())
    finished = False
    try:
        yield _chunk(entry, created, {"role": "assistant", "content": ""})
        follower = TextFollower()
        view = None
        try:
            async for item in _follow(conn, entry.job_id, follower):
                if isinstance(item, str):
                    yield _chunk(entry, created, {"content": item})
                else:
                    view = item
                    yield _comment(view)
        except (RingqError, redis.RedisError) as exc:  # Redis went away, the record expired...
            log.warning("job %s: stream ended early: %s", entry.job_id, exc)
            yield _error(ApiError(503, f"job {entry.job_id}: {exc}", type_="server_error"))
            return
        assert view is not None
        finished = True
        async for event in _ending(entry, created, view, follower, include_usage):
            yield event
    finally:
        if not finished:  # the caller went away mid-job (no await: this task is cancelled)
            cancel_quietly(conn, entry.job_id)


async def _ending(
    entry: BatchEntry, created: int, view: JobView, follower: TextFollower, include_usage: bool
) -> AsyncIterator[str]:
    """The events after the job is final: the rest of its text, finish_reason, usage, [DONE]."""
    try:
        raise_unless_finished(view)
    except ApiError as exc:
        yield _error(exc)
        return
    body = completion(entry, view)
    choice = body["choices"][0]
    rest = follower.rest(choice["message"]["content"])
    if rest is None:  # a retried attempt generated other text than the one streamed
        message = f"job {entry.job_id}: its text changed when it was retried; ask again"
        yield _error(ApiError(500, message, type_="server_error", code="stream_diverged"))
        return
    if rest:
        yield _chunk(entry, created, {"content": rest})
    yield _chunk(entry, created, {}, finish_reason=choice["finish_reason"])
    if include_usage:
        yield _data({**_chunk_head(entry, created), "choices": [], "usage": body["usage"]})
    yield "data: [DONE]\n\n"


async def _follow(conn: Conn, job_id: str, follower: TextFollower) -> AsyncIterator[str | JobView]:
    """New text (str) as the job's text stream grows, and the job's view (JobView) whenever its
    progress changes (at least every KEEPALIVE_S), ending with its final view. The text stream
    is read once more after the job is seen final: its rank appends the text before it
    finishes, so nothing is left behind."""
    after_id, last, sent_at = "0", None, 0.0
    while True:
        view = await run_in_threadpool(read_view, conn, job_id)
        final = view.state.is_final
        wait_ms = None if final else TEXT_WAIT_MS
        deltas, after_id = await anyio.to_thread.run_sync(
            read_text, conn, job_id, after_id, wait_ms, limiter=STREAM_READERS
        )
        for delta in deltas:
            if text := follower.take(delta):
                yield text
        now = time.monotonic()
        if final or view.progress != last or now - sent_at >= KEEPALIVE_S:
            last, sent_at = view.progress, now
            yield view
        if final:
            return


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


def _comment(view: JobView) -> str:
    progress = view.progress
    return f": {progress.phase.value} {progress.processed}/{progress.total}\n\n"


def _error(exc: ApiError) -> str:
    return _data(error_body(exc.message, exc.type, exc.param, exc.code))


def _data(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
