"""ASGI guards around the whole app: bodies bounded before they are buffered, JSON nesting
bounded before it is parsed, and headers that keep other sites from framing any answer.

A body is counted as it streams in: past the limit (RINGQ_MAX_REQUEST_BYTES; uploads to
/v1/files RINGQ_MAX_UPLOAD_BYTES) the read fails with 413, and a Content-Length over it is
refused before a byte is read. Other bodies have their nesting measured first: Python's json
recurses, and `[` x 100,000 would raise RecursionError deep inside the route."""

import json
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.exceptions import HTTPException

from cli.http.errors import error_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

UPLOAD_PATH = "/v1/files"
SECURITY_HEADERS = [
    (b"x-frame-options", b"DENY"),
    (b"content-security-policy", b"frame-ancestors 'none'"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
]
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


class BodyTooLarge(Exception):
    pass


def json_depth(body: bytes) -> int:
    """How deep arrays and objects nest in `body` (strings skipped; malformed JSON is the
    parser's to report)."""
    brackets = _JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKETS)
    depth = deepest = 0
    for byte in brackets:
        depth += 1 if byte in b"[{" else -1
        deepest = max(deepest, depth)
    return deepest


class SecurityHeaders:
    """Anti-framing and no-sniffing headers on every answer (the outermost layer)."""

    def __init__(self, app: App):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *SECURITY_HEADERS]
            await send(message)

        await self.app(scope, receive, send_with_headers if scope["type"] == "http" else send)


class BodyLimits:
    """The body limits, inside the key check: a caller without a key gets nothing buffered."""

    def __init__(
        self, app: App, max_request_bytes: int, max_upload_bytes: int, max_json_depth: int
    ):
        self.app = app
        self.max_request_bytes = max_request_bytes
        self.max_upload_bytes = max_upload_bytes
        self.max_json_depth = max_json_depth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", []))
        upload = scope["path"] == UPLOAD_PATH and scope["method"] == "POST"
        limit = self.max_upload_bytes if upload else self.max_request_bytes
        declared = headers.get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > limit:
            await _refuse(send, 413, _too_large(limit, upload))
            return
        if upload and headers.get(b"content-type", b"").startswith(b"multipart/"):
            await self.app(scope, _counted(receive, limit, _too_large(limit, upload)), send)
            return
        try:
            body = await _read_all(receive, limit)
        except BodyTooLarge:
            await _refuse(send, 413, _too_large(limit, upload))
            return
        if body and json_depth(body) > self.max_json_depth:
            message = f"the JSON nests deeper than {self.max_json_depth} levels"
            await _refuse(send, 400, message)
            return
        await self.app(scope, _replay(body, receive), send)


def _too_large(limit: int, upload: bool) -> str:
    setting = "RINGQ_MAX_UPLOAD_BYTES" if upload else "RINGQ_MAX_REQUEST_BYTES"
    return f"the request body is over the limit of {limit} bytes ({setting})"


def _counted(receive: Receive, limit: int, message: str) -> Receive:
    """`receive` that fails the read with 413 past `limit` bytes (FastAPI answers an
    HTTPException raised while it parses a form as it is)."""
    seen = 0

    async def counted() -> Message:
        nonlocal seen
        received = await receive()
        seen += len(received.get("body", b""))
        if seen > limit:
            raise HTTPException(413, message)
        return received

    return counted


async def _read_all(receive: Receive, limit: int) -> bytes:
    chunks: list[bytes] = []
    seen = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks)
        chunk = message.get("body", b"")
        seen += len(chunk)
        if seen > limit:
            raise BodyTooLarge
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # http.disconnect, when the client goes

    return replay


async def _refuse(send: Send, status: int, message: str) -> None:
    code = "request_too_large" if status == 413 else "invalid_value"
    body = json.dumps(error_body(message, "invalid_request_error", None, code)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"connection", b"close")],
        }
    )
    await send({"type": "http.response.body", "body": body})
