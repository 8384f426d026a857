"""A chat completion job's end as the API answers it: its completion body, or an error."""

from contextlib import suppress
from typing import Any

from cli.http.deps import Conn
from cli.http.errors import ApiError
from cli.http.job_views import JobView
from jobs.batch import output_line
from jobs.cancel import cancel_job
from jobs.errors import RingqError
from jobs.lifecycle import JobState
from jobs.schemas import BatchEntry, JobKind
from jobs.store import JobStore


def cancel_quietly(conn: Conn, job_id: str) -> None:
    with suppress(RingqError):  # it ended meanwhile
        cancel_job(JobStore(conn), job_id)


def raise_unless_finished(view: JobView) -> None:
    if view.state == JobState.FINISHED and view.result is not None:
        return
    message = f"job {view.id} {view.state.value}: {view.error or 'no result'}"
    if view.state == JobState.CANCELLED:
        raise ApiError(409, message, code="job_cancelled")
    if view.placement is None:  # refused at admission: the request's own fault
        raise ApiError(400, message, code="job_rejected")
    raise ApiError(500, message, type_="server_error", code="job_failed")


def completion(entry: BatchEntry, view: JobView) -> dict[str, Any]:
    assert view.result is not None
    line = output_line(entry, JobKind.GENERATE, view.result, view.updated_at)
    return line["response"]["body"]
