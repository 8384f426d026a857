"""One snapshot of the whole service for `ringq top`: RQ queue lengths, live nodes, running jobs,
idle warm groups.

Read-only and cheap enough to poll every second: running jobs are found by reading only the
`state` field of every indexed job (pipelined, a chunk per round trip), and only the small
fields of live ones are fetched, never a spec (which holds the whole document)."""

import json
import time
from collections.abc import Iterator
from typing import Any

import redis
from pydantic import BaseModel, ConfigDict

from jobs import keys
from jobs.lifecycle import JobState
from jobs.reservations import Reservations
from jobs.schemas import JobKind, NodeInfo, Placement, Progress
from jobs.service_status import ServiceStatus, read_service_statuses
from jobs.store import JobStore
from jobs.submit import admit_queue, node_queue
from jobs.warm_groups import WarmGroups

RUNNING_STATES = frozenset({JobState.ADMITTED, JobState.LOADING, JobState.PREFILL, JobState.DECODE})
SCAN_CHUNK_JOBS = 1000
_RUNNING_FIELDS = ("kind", "state", "progress", "placement", "created_at")


class _Row(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class QueueRow(_Row):
    """One RQ queue: jobs waiting in it and jobs a worker has taken but not finished."""

    name: str
    queued: int
    started: int


class RunningJob(_Row):
    id: str
    kind: JobKind
    state: JobState
    progress: Progress
    placement: Placement | None
    created_at: float
    eta_s: float | None


class IdleGroup(_Row):
    """A warm group waiting for its next job (jobs/warm_groups.py)."""

    group_id: str
    model: str
    strategy: str
    nodes: list[str]
    bytes_per_node: int


class Overview(_Row):
    taken_at: float
    queues: list[QueueRow]
    nodes: list[NodeInfo]
    reserved_bytes: dict[str, int]  # node -> bytes held by running groups' reservations
    running: list[RunningJob]
    idle_groups: list[IdleGroup] = []
    services: list[ServiceStatus] = []  # what `ringq up` supervises: state, restarts


def take_overview(conn: redis.Redis) -> Overview:
    """Queues (the admit queue, then every registered node's), live nodes, running jobs."""
    store = JobStore(conn)
    nodes = store.live_nodes()
    return Overview(
        taken_at=time.time(),
        queues=queue_rows(conn),
        nodes=nodes,
        reserved_bytes=reserved_per_node(conn, [n.name for n in nodes]),
        running=running_jobs(conn),
        idle_groups=[
            IdleGroup(
                group_id=g.group_id,
                model=g.model,
                strategy=g.strategy,
                nodes=g.nodes,
                bytes_per_node=held,
            )
            for g, held in WarmGroups(conn).idle()
        ],
        services=read_service_statuses(conn),
    )


def reserved_per_node(conn: redis.Redis, names: list[str]) -> dict[str, int]:
    reservations = Reservations(conn, lease_s=0)  # read only: the lease length is not used
    return {name: reservations.reserved_bytes(name) for name in names}


def queue_rows(conn: redis.Redis) -> list[QueueRow]:
    names = sorted(_text(n) for n in conn.smembers(keys.NODES_INDEX))
    queues = [admit_queue(conn)] + [node_queue(conn, name) for name in names]
    return [
        QueueRow(name=q.name, queued=q.count, started=q.started_job_registry.count) for q in queues
    ]


def running_jobs(conn: redis.Redis, chunk_jobs: int = SCAN_CHUNK_JOBS) -> list[RunningJob]:
    """Every indexed job whose state is admitted, loading, prefill or decode, oldest first."""
    found: list[RunningJob] = []
    for ids in _indexed_ids(conn, chunk_jobs):
        with conn.pipeline(transaction=False) as pipe:
            for job_id in ids:
                pipe.hget(keys.job(job_id), "state")
            states = pipe.execute()
        live = [i for i, s in zip(ids, states, strict=True) if s and _is_running(s)]
        if not live:
            continue
        with conn.pipeline(transaction=False) as pipe:
            for job_id in live:
                pipe.hmget(keys.job(job_id), _RUNNING_FIELDS)
            rows = pipe.execute()
        found += [_running_job(i, r) for i, r in zip(live, rows, strict=True) if None not in r]
    return found


def eta_s(progress: Progress) -> float | None:
    """Seconds left in prefill at the current speed; None when there is no speed to go by."""
    if progress.phase != JobState.PREFILL or progress.prompt_tps <= 0:
        return None
    return max(progress.total - progress.processed, 0) / progress.prompt_tps


def _indexed_ids(conn: redis.Redis, chunk_jobs: int) -> Iterator[list[str]]:
    start = 0
    while True:
        chunk = conn.zrange(keys.JOBS_INDEX, start, start + chunk_jobs - 1)
        if not chunk:
            return
        yield [_text(i) for i in chunk]
        start += chunk_jobs


def _is_running(raw_state: bytes | str) -> bool:
    return JobState(json.loads(raw_state)) in RUNNING_STATES


def _running_job(job_id: str, raw: list[Any]) -> RunningJob:
    fields = dict(zip(_RUNNING_FIELDS, (json.loads(v) for v in raw), strict=True))
    progress = Progress.model_validate(fields["progress"])
    return RunningJob(id=job_id, eta_s=eta_s(progress), **{**fields, "progress": progress})


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
