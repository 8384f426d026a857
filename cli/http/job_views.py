"""Jobs as the API shows them: every field of the record but the spec, whose document may be
megabytes. Read with HMGET of the small fields only, pipelined for many jobs."""

import json
from collections.abc import Sequence
from typing import Any

import redis

from jobs import keys
from jobs.errors import JobNotFoundError
from jobs.listing import eta_s
from jobs.model_catalog import PACKAGED_MODELS
from jobs.random_models import PREFIX, PRESETS
from jobs.schemas import JobHeader, JobRecord, JobResult, Progress, header_fields

VIEW_FIELDS = (*header_fields(JobHeader), "result")


class JobView(JobHeader):
    """A job as the API shows it: its header, its result, and the ETA of its current phase."""

    result: JobResult | None = None
    eta_s: float | None = None  # seconds left in the current phase (eta_for)


def read_view(conn: redis.Redis, job_id: str) -> JobView:
    [view] = read_views(conn, [job_id], missing_ok=False)
    assert view is not None
    return view


def read_views(
    conn: redis.Redis, job_ids: Sequence[str], missing_ok: bool = True
) -> list[JobView | None]:
    with conn.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            pipe.hmget(keys.job(job_id), VIEW_FIELDS)
        rows = pipe.execute()
    views: list[JobView | None] = []
    for job_id, row in zip(job_ids, rows, strict=True):
        if row[0] is None:
            if not missing_ok:
                raise JobNotFoundError(f"no job {job_id!r} (it never existed or it expired)")
            views.append(None)
            continue
        fields: dict[str, Any] = {
            name: json.loads(value)
            for name, value in zip(VIEW_FIELDS, row, strict=True)
            if value is not None
        }
        progress = Progress.model_validate(fields.pop("progress"))
        views.append(JobView(id=job_id, progress=progress, eta_s=eta_s(progress), **fields))
    return views


def spec_json(record: JobRecord) -> dict[str, Any]:
    """The spec without its document (its size and name instead; a final job's record keeps
    only the size)."""
    spec = record.spec.model_dump(mode="json", exclude={"document"})
    chars = record.document_chars
    return {**spec, "document_chars": len(record.spec.document) if chars is None else chars}


def served_models() -> list[str]:
    return [*PACKAGED_MODELS, *(PREFIX + name for name in PRESETS)]
