"""Putting jobs into Redis: a record plus an RQ job on the admit queue (JSON serializer only)."""

import uuid

import redis
from rq import Queue
from rq.serializers import JSONSerializer

from jobs import keys
from jobs.errors import InvalidJobError
from jobs.model_catalog import resolve_model
from jobs.schemas import JobRecord, JobSpec, check_job_id
from jobs.store import JobStore


def admit_queue(conn: redis.Redis) -> Queue:
    return Queue(keys.ADMIT_QUEUE, connection=conn, serializer=JSONSerializer)


def node_queue(conn: redis.Redis, node_name: str) -> Queue:
    return Queue(keys.node_queue(node_name), connection=conn, serializer=JSONSerializer)


def new_job_id() -> str:
    return uuid.uuid4().hex[:12]


def submit_job(conn: redis.Redis, spec: JobSpec, job_id: str | None = None) -> JobRecord:
    """Validate, record and enqueue one job; returns its record (state queued)."""
    try:
        job_id = check_job_id(job_id) if job_id else new_job_id()
    except ValueError as exc:
        raise InvalidJobError(str(exc)) from None
    resolve_model(spec.model)  # an unknown model is the user's error: say so now, not later
    record = JobStore(conn).create(job_id, spec)
    admit_queue(conn).enqueue(
        "jobs.dispatcher.admit_job", job_id, job_id=f"admit-{job_id}", result_ttl=3600
    )
    return record
