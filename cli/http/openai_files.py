"""OpenAI's /v1/files: upload (purpose "batch"), retrieve, list, content, delete."""

from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Form, Query, UploadFile
from fastapi.responses import Response

from cli.http.deps import Config, Conn
from cli.http.errors import ApiError
from cli.http.file_store import MAX_UPLOAD_BYTES, FileObject, FileStore
from jobs.files import printable_name

router = APIRouter(prefix="/v1/files")


def file_store(conn: Conn, settings: Config) -> FileStore:
    return FileStore(conn, settings.job_ttl_s)


@router.post("")
async def upload(
    conn: Conn, settings: Config, file: UploadFile, purpose: Annotated[str, Form()]
) -> FileObject:
    if purpose != "batch":
        raise ApiError(
            400,
            f"purpose {purpose!r} is not supported: ringq takes batch input files (purpose "
            "'batch')",
            param="purpose",
            code="invalid_value",
        )
    content = await file.read(MAX_UPLOAD_BYTES + 1)
    if len(content) > MAX_UPLOAD_BYTES:
        raise ApiError(413, f"the file is over the limit of {MAX_UPLOAD_BYTES} bytes", param="file")
    if not content.strip():
        raise ApiError(
            400, "the file is empty: a batch file holds one request a line", param="file"
        )
    name = printable_name(Path(file.filename or "upload.jsonl"))
    return file_store(conn, settings).put(name, "batch", content)


@router.get("")
def list_files(
    conn: Conn,
    settings: Config,
    purpose: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10000)] = 10000,
    after: str | None = None,
    order: Annotated[str, Query(pattern="^(asc|desc)$")] = "desc",
) -> dict[str, Any]:
    files, has_more = file_store(conn, settings).list(purpose, limit, after, order == "desc")
    return page(files, has_more)


@router.get("/{file_id}")
def retrieve(conn: Conn, settings: Config, file_id: str) -> FileObject:
    return file_store(conn, settings).get(file_id)


@router.get("/{file_id}/content")
def content(conn: Conn, settings: Config, file_id: str) -> Response:
    data = file_store(conn, settings).content(file_id)
    return Response(data, media_type="application/jsonl")


@router.delete("/{file_id}")
def delete(conn: Conn, settings: Config, file_id: str) -> dict[str, Any]:
    file_store(conn, settings).delete(file_id)
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
