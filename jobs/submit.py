"""Putting jobs into Redis: a record plus an RQ job on the admit queue (JSON serializer only)."""

import time
import uuid
from collections.abc import Sequence

import redis
from rq import Queue, Retry
from rq.queue import EnqueueData
from rq.serializers import JSONSerializer

from jobs import keys
from jobs.errors import InvalidJobError
from jobs.model_info import check_spec
from jobs.schemas import JobRecord, JobSpec, check_job_id
from jobs.settings import Settings, get_settings
from jobs.store import ORDER_STEP_S, JobStore

ADMIT_TIMEOUT_S = 60  # one admission: tokenising the largest document allowed fits well within


def admit_queue(conn: redis.Redis) -> Queue:
    return Queue(keys.ADMIT_QUEUE, connection=conn, serializer=JSONSerializer)


def node_queue(conn: redis.Redis, node_name: str) -> Queue:
    return Queue(keys.node_queue(node_name), connection=conn, serializer=JSONSerializer)


def new_job_id() -> str:
    return uuid.uuid4().hex[:12]


def submit_job(
    conn: redis.Redis, spec: JobSpec, job_id: str | None = None, settings: Settings | None = None
) -> JobRecord:
    """Validate, record and enqueue one job; returns its record (state queued). `settings`:
    the caller's (RINGQ_ALLOWED_DIRS, the model cache, the TTL); None: this process's."""
    try:
        job_id = check_job_id(job_id) if job_id else new_job_id()
    except ValueError as exc:
        raise InvalidJobError(str(exc)) from None
    settings = settings or get_settings()  # a library entry point: scripts and tests call it
    spec = check_spec(spec, settings)  # an unknown model, too many max_tokens: the user's error
    record = JobStore(conn, settings.job_ttl_s).create(job_id, spec)
    admit_queue(conn).enqueue_many([admit_data(job_id)])
    return record


def admit_data(job_id: str, attempt: str = "", wake: bool = False) -> EnqueueData:
    """The dispatcher's RQ job for one ringq job (`attempt` names a later try; `wake`: an
    extra try at the front of the queue, as room freed). Admission is idempotent, so RQ may
    run it again when a dispatcher died running it (an abandoned job)."""
    return Queue.prepare_data(
        "jobs.dispatcher.admit_job",
        (job_id,),
        {"wake": True} if wake else None,
        at_front=wake,
        job_id=f"admit-{job_id}{attempt}",
        timeout=ADMIT_TIMEOUT_S,
        result_ttl=600,
        retry=Retry(max=3),
    )


def enqueue_jobs(
    conn: redis.Redis,
    jobs: Sequence[tuple[str, JobSpec]],
    chunk_jobs: int = 1000,
    settings: Settings | None = None,
) -> list[JobRecord]:
    """Record and enqueue many jobs with a few pipelines (one round trip per `chunk_jobs`)
    instead of several round trips each. Ids are not checked to be free: pass fresh ones.
    Each job's record is written before its RQ job, so the dispatcher never finds an RQ job
    without its record. `settings` as for submit_job."""
    settings = settings or get_settings()
    jobs = [(job_id, check_spec(spec, settings)) for job_id, spec in jobs]  # metadata is cached
    store, queue = JobStore(conn, settings.job_ttl_s), admit_queue(conn)
    records: list[JobRecord] = []
    for start in range(0, len(jobs), chunk_jobs):
        chunk = jobs[start : start + chunk_jobs]
        # in the order given, also across chunks (created_at is the queue order)
        now = max(time.time(), records[-1].created_at + ORDER_STEP_S if records else 0.0)
        # No MULTI: a transaction's per-command replies double the parsing, and the order of
        # commands on one connection already writes every record before its RQ job.
        with conn.pipeline(transaction=False) as pipe:
            records += store.create_in(pipe, chunk, now)
            queue.enqueue_many([admit_data(job_id) for job_id, _ in chunk], pipeline=pipe)
            pipe.execute()
    return records
