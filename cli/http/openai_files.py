"""OpenAI's /v1/files: upload (purpose "batch"), retrieve, list, content, delete."""

from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Form, Query, UploadFile
from fastapi.responses import FileResponse
from starlette.concurrency import run_in_threadpool

from cli.http.deps import Config, Conn
from cli.http.errors import ApiError
from cli.http.file_store import FileObject, FileStore
from cli.http.tenants import Caller
from jobs.errors import InvalidJobError
from jobs.files import printable_name

router = APIRouter(prefix="/v1/files")


def file_store(conn: Conn, settings: Config) -> FileStore:
    return FileStore(conn, settings)


@router.post("")
async def upload(
    conn: Conn, settings: Config, tenant: Caller, file: UploadFile, purpose: Annotated[str, Form()]
) -> FileObject:
    """The upload arrives spooled by the multipart parser (bounded by RINGQ_MAX_UPLOAD_BYTES
    in cli/http/guards.py) and is copied to disk in chunks: never whole in memory."""
    if purpose != "batch":
        raise ApiError(
            400,
            f"purpose {purpose!r} is not supported: ringq takes batch input files (purpose "
            "'batch')",
            param="purpose",
            code="invalid_value",
        )
    name = printable_name(Path(file.filename or "upload.jsonl"))
    store = file_store(conn, settings)
    try:
        return await run_in_threadpool(store.put_stream, name, "batch", file.file, tenant)
    except InvalidJobError as exc:
        raise ApiError(400, str(exc), param="file") from None


@router.get("")
def list_files(
    conn: Conn,
    settings: Config,
    tenant: Caller,
    purpose: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10000)] = 10000,
    after: str | None = None,
    order: Annotated[str, Query(pattern="^(asc|desc)$")] = "desc",
) -> dict[str, Any]:
    store = file_store(conn, settings)
    files, has_more = store.list(tenant, purpose, limit, after, order == "desc")
    return page(files, has_more)


@router.get("/{file_id}")
def retrieve(conn: Conn, settings: Config, tenant: Caller, file_id: str) -> FileObject:
    return file_store(conn, settings).get(file_id, tenant).public()


@router.get("/{file_id}/content")
def content(conn: Conn, settings: Config, tenant: Caller, file_id: str) -> FileResponse:
    path = file_store(conn, settings).path(file_id, tenant)
    return FileResponse(path, media_type="application/jsonl")


@router.delete("/{file_id}")
def delete(conn: Conn, settings: Config, tenant: Caller, file_id: str) -> dict[str, Any]:
    file_store(conn, settings).delete(file_id, tenant)
    return {"id": file_id, "object": "file", "deleted": True}


def page(items: list[Any], has_more: bool) -> dict[str, Any]:
    """OpenAI's cursor page: the client asks again with after=last_id while has_more."""
    data = [item.model_dump(mode="json") if hasattr(item, "model_dump") else item for item in items]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }
