"""Files of the OpenAI-compatible API, kept in Redis: a JSON object per file plus its bytes.

Uploads (purpose "batch") are batch inputs; a batch writes its output and error files here
(purpose "batch_output"). Both expire with the jobs (RINGQ_JOB_TTL_S). Bytes are only ever
returned as they are: nothing here is unpickled or executed."""

import time
import uuid
from typing import Literal

import redis
from pydantic import BaseModel, ConfigDict

from jobs import keys
from jobs.errors import JobNotFoundError

MAX_UPLOAD_BYTES = 200 * 1024 * 1024  # OpenAI allows 200 MB batch input files
Purpose = Literal["batch", "batch_output"]


class FileObject(BaseModel):
    """OpenAI's file object."""

    model_config = ConfigDict(frozen=True)

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: Purpose
    status: Literal["processed"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class FileNotFoundInStoreError(JobNotFoundError):
    """No file with that id (never uploaded, deleted or expired)."""


class FileStore:
    def __init__(self, conn: redis.Redis, ttl_s: int):
        self.conn = conn
        self.ttl_s = ttl_s

    def put(self, filename: str, purpose: Purpose, content: bytes) -> FileObject:
        now = int(time.time())
        meta = FileObject(
            id=f"file-{uuid.uuid4().hex[:24]}",
            bytes=len(content),
            created_at=now,
            filename=filename,
            purpose=purpose,
            expires_at=now + self.ttl_s,
        )
        with self.conn.pipeline() as pipe:
            pipe.set(keys.file_content(meta.id), content, ex=self.ttl_s)
            pipe.set(keys.file_meta(meta.id), meta.model_dump_json(), ex=self.ttl_s)
            pipe.zadd(keys.FILES_INDEX, {meta.id: time.time()})  # not `now`: whole seconds tie
            pipe.execute()
        return meta

    def get(self, file_id: str) -> FileObject:
        raw = self.conn.get(keys.file_meta(file_id))
        if raw is None:
            raise FileNotFoundInStoreError(f"no file {file_id!r} (never uploaded, or deleted)")
        return FileObject.model_validate_json(raw)

    def content(self, file_id: str) -> bytes:
        self.get(file_id)
        raw = self.conn.get(keys.file_content(file_id))
        if raw is None:
            raise FileNotFoundInStoreError(f"file {file_id!r} has no content (it expired)")
        return raw if isinstance(raw, bytes) else str(raw).encode()

    def delete(self, file_id: str) -> None:
        self.get(file_id)
        with self.conn.pipeline() as pipe:
            pipe.delete(keys.file_meta(file_id), keys.file_content(file_id))
            pipe.zrem(keys.FILES_INDEX, file_id)
            pipe.execute()

    def list(
        self, purpose: str | None, limit: int, after: str | None, newest_first: bool
    ) -> tuple[list[FileObject], bool]:
        """A page of files (expired ones are dropped from the index) and whether more follow."""
        ids = [_text(i) for i in self.conn.zrange(keys.FILES_INDEX, 0, -1, desc=newest_first)]
        if after is not None and after in ids:
            ids = ids[ids.index(after) + 1 :]
        raw = self.conn.mget([keys.file_meta(i) for i in ids]) if ids else []
        gone = [i for i, r in zip(ids, raw, strict=True) if r is None]
        if gone:
            self.conn.zrem(keys.FILES_INDEX, *gone)
        files = [FileObject.model_validate_json(r) for r in raw if r is not None]
        files = [f for f in files if purpose is None or f.purpose == purpose]
        return files[:limit], len(files) > limit


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
