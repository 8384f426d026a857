"""Every error the HTTP API answers, in OpenAI's shape: {"error": {message, type, param, code}}.

ringq's own exceptions map to status codes here, once; routes raise them (or ApiError) and never
build error responses themselves. Anything unexpected is logged and answered as a 500 without a
traceback."""

import logging
from collections.abc import Mapping

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from jobs.errors import (
    AdmissionError,
    CorruptRecordError,
    ForbiddenPathError,
    IllegalTransitionError,
    InvalidJobError,
    JobNotFoundError,
    RedisUnavailableError,
    RingqError,
    UnknownModelError,
)

log = logging.getLogger(__name__)

# (status, OpenAI error type, code) per ringq exception; the first match wins (subclasses first).
_RINGQ_ERRORS: list[tuple[type[RingqError], int, str, str]] = [
    (JobNotFoundError, 404, "invalid_request_error", "not_found"),
    (UnknownModelError, 404, "invalid_request_error", "model_not_found"),
    (ForbiddenPathError, 403, "invalid_request_error", "forbidden_path"),
    (InvalidJobError, 400, "invalid_request_error", "invalid_value"),
    (AdmissionError, 400, "invalid_request_error", "does_not_fit"),
    (IllegalTransitionError, 409, "invalid_request_error", "conflict"),
    (RedisUnavailableError, 503, "server_error", "redis_unavailable"),
    (CorruptRecordError, 500, "server_error", "corrupt_record"),
]
_HTTP_TYPES = {401: "authentication_error", 403: "permission_error", 404: "invalid_request_error"}


class ApiError(Exception):
    """An error a route answers with: HTTP status, message, and OpenAI's type/param/code."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code


def error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, dict[str, str | None]]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(exc: ApiError, headers: Mapping[str, str] | None = None) -> JSONResponse:
    body = error_body(exc.message, exc.type, exc.param, exc.code)
    return JSONResponse(body, status_code=exc.status, headers=headers)


def from_ringq(exc: RingqError) -> ApiError:
    param = getattr(exc, "param", None)
    if isinstance(exc, UnknownModelError):
        param = "model"
    for kind, status, type_, code in _RINGQ_ERRORS:
        if isinstance(exc, kind):
            return ApiError(status, str(exc), type_=type_, code=code, param=param)
    return ApiError(500, str(exc), type_="server_error", code="ringq_error")


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """One line naming each bad field, and the first field's name (OpenAI's `param`)."""
    parts, params = [], []
    for error in errors:
        loc = [str(p) for p in error.get("loc", ()) if p not in ("body", "query", "path")]
        where = ".".join(loc)
        params.append(where or None)
        parts.append(f"{where}: {error['msg']}" if where else str(error["msg"]))
    return "; ".join(parts) or "invalid request", params[0] if params else None


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RingqError)
    async def _ringq(request: Request, exc: RingqError) -> JSONResponse:
        return error_response(from_ringq(exc))

    @app.exception_handler(RequestValidationError)
    async def _request(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(exc.errors()))
        return error_response(ApiError(400, message, param=param, code="invalid_value"))

    @app.exception_handler(ValidationError)
    async def _model(request: Request, exc: ValidationError) -> JSONResponse:
        errors = [dict(e) for e in exc.errors()]
        message, param = validation_message(errors)
        return error_response(ApiError(400, message, param=param, code="invalid_value"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = _HTTP_TYPES.get(exc.status_code, "invalid_request_error")
        message = str(exc.detail) if exc.status_code != 404 else f"no route {request.url.path}"
        code = "request_too_large" if exc.status_code == 413 else None
        return error_response(
            ApiError(exc.status_code, message, type_=type_, code=code), exc.headers
        )

    @app.exception_handler(redis.ConnectionError)
    async def _redis(request: Request, exc: redis.ConnectionError) -> JSONResponse:
        message = f"Redis is unreachable: {exc}"
        return error_response(
            ApiError(503, message, type_="server_error", code="redis_unavailable")
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        message = "internal error (the server's log has its details)"  # no paths, no stack
        return error_response(ApiError(500, message, type_="server_error", code="internal_error"))
