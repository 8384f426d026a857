"""Files of the OpenAI-compatible API: a JSON object per file in Redis, its bytes on disk under
RINGQ_HOME/files/<id> (0600; the folder 0700).

Bytes stay out of Redis: Redis holds everything in memory and again in its append-only file, and
the embedded Redis has no memory cap. `ringq serve` is the only process that reads and writes
them; a file expires with its Redis object (RINGQ_JOB_TTL_S), and each write sweeps the bytes of
files that have expired.

Uploads (purpose "batch") are batch inputs; a batch writes its output and error files here
(purpose "batch_output"). Each file belongs to the tenant that made it (cli/http/tenants.py).
Bytes are only ever returned as they are: nothing here is unpickled or executed."""

import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, Literal

import redis
from pydantic import BaseModel, ConfigDict

from cli.http.tenants import EVERYONE, Tenant
from jobs import keys
from jobs.errors import InvalidJobError, JobNotFoundError
from jobs.settings import Settings

Purpose = Literal["batch", "batch_output"]
COPY_CHUNK_BYTES = 1024 * 1024


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


class StoredFile(FileObject):
    """A file object as kept in Redis: with its owner (None: no keys were set)."""

    owner: str | None = None

    def public(self) -> FileObject:
        return FileObject.model_validate(self.model_dump(exclude={"owner"}))


class FileNotFoundInStoreError(JobNotFoundError):
    """No file with that id (never uploaded, deleted, expired, or another tenant's)."""


class FileStore:
    def __init__(self, conn: redis.Redis, settings: Settings):
        self.conn = conn
        self.ttl_s = settings.job_ttl_s
        self.folder = settings.home / "files"

    def put(self, filename: str, purpose: Purpose, content: bytes, owner: Tenant) -> FileObject:
        file_id = new_file_id()
        self._write(file_id, lambda out: out.write(content))
        return self._record(file_id, filename, purpose, len(content), owner)

    def put_stream(
        self, filename: str, purpose: Purpose, stream: BinaryIO, owner: Tenant
    ) -> FileObject:
        """Copy `stream` to disk in chunks; InvalidJobError when it holds only whitespace."""
        file_id = new_file_id()
        size, blank = 0, True

        def copy(out: BinaryIO) -> None:
            nonlocal size, blank
            while chunk := stream.read(COPY_CHUNK_BYTES):
                size += len(chunk)
                blank = blank and not chunk.strip()
                out.write(chunk)

        self._write(file_id, copy)
        if blank:
            self._path(file_id).unlink(missing_ok=True)
            raise InvalidJobError("the file is empty: a batch file holds one request a line")
        return self._record(file_id, filename, purpose, size, owner)

    def get(self, file_id: str, tenant: Tenant = EVERYONE) -> StoredFile:
        raw = self.conn.get(keys.file_meta(file_id))
        found = StoredFile.model_validate_json(raw) if raw is not None else None
        if found is None or not tenant.sees(found.owner):
            raise FileNotFoundInStoreError(f"no file {file_id!r} (never uploaded, or deleted)")
        return found

    def path(self, file_id: str, tenant: Tenant = EVERYONE) -> Path:
        """Where the file's bytes are; FileNotFoundInStoreError when they are gone."""
        self.get(file_id, tenant)
        path = self._path(file_id)
        if not path.is_file():
            raise FileNotFoundInStoreError(f"file {file_id!r} has no content (it expired)")
        return path

    def content(self, file_id: str, tenant: Tenant = EVERYONE) -> bytes:
        return self.path(file_id, tenant).read_bytes()

    def delete(self, file_id: str, tenant: Tenant) -> None:
        self.get(file_id, tenant)
        with self.conn.pipeline() as pipe:
            pipe.delete(keys.file_meta(file_id), keys.file_content(file_id))
            pipe.zrem(keys.FILES_INDEX, file_id)
            pipe.execute()
        self._path(file_id).unlink(missing_ok=True)

    def list(
        self, tenant: Tenant, purpose: str | None, limit: int, after: str | None, newest_first: bool
    ) -> tuple[list[FileObject], bool]:
        """A page of the tenant's files (expired ones are dropped from the index) and whether
        more follow."""
        ids = [_text(i) for i in self.conn.zrange(keys.FILES_INDEX, 0, -1, desc=newest_first)]
        if after is not None and after in ids:
            ids = ids[ids.index(after) + 1 :]
        raw = self.conn.mget([keys.file_meta(i) for i in ids]) if ids else []
        gone = [i for i, r in zip(ids, raw, strict=True) if r is None]
        if gone:
            self.conn.zrem(keys.FILES_INDEX, *gone)
        files = [StoredFile.model_validate_json(r) for r in raw if r is not None]
        files = [f for f in files if tenant.sees(f.owner)]
        files = [f for f in files if purpose is None or f.purpose == purpose]
        return [f.public() for f in files[:limit]], len(files) > limit

    def _record(
        self, file_id: str, filename: str, purpose: Purpose, size: int, owner: Tenant
    ) -> FileObject:
        now = int(time.time())
        meta = StoredFile(
            id=file_id,
            bytes=size,
            created_at=now,
            filename=filename,
            purpose=purpose,
            expires_at=now + self.ttl_s,
            owner=owner.id,
        )
        with self.conn.pipeline() as pipe:
            pipe.set(keys.file_meta(meta.id), meta.model_dump_json(), ex=self.ttl_s)
            pipe.zadd(keys.FILES_INDEX, {meta.id: time.time()})  # not `now`: whole seconds tie
            pipe.execute()
        return meta.public()

    def _write(self, file_id: str, fill: Callable[[BinaryIO], object]) -> None:
        """The bytes `fill` writes, as RINGQ_HOME/files/<id> (written aside, then renamed)."""
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._sweep()
        partial = self.folder / f".{file_id}.partial"
        descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "wb") as out:
            fill(out)
        partial.replace(self._path(file_id))

    def _sweep(self) -> None:
        """Delete bytes older than the TTL: their Redis objects have expired."""
        oldest = time.time() - self.ttl_s
        for path in self.folder.iterdir():
            try:
                if path.stat().st_mtime < oldest:
                    path.unlink()
            except FileNotFoundError:
                continue

    def _path(self, file_id: str) -> Path:
        if not file_id.startswith("file-") or not file_id[5:].isalnum():
            raise FileNotFoundInStoreError(f"no file {file_id!r}")
        return self.folder / file_id


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex[:24]}"


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
