"""One snapshot of the whole service for `ringq top`: RQ queue lengths, live nodes, running and
queued jobs, idle warm groups. Cheap enough to poll every second: jobs are read from the
per-state indexes (jobs/listing.py), small fields only."""

import json
import time
from collections import Counter
from typing import Any

import redis
from pydantic import BaseModel, ConfigDict

from jobs import keys
from jobs.lifecycle import JobState
from jobs.listing import JobSummary, ensure_state_indexes, eta_s, summaries
from jobs.reservations import Reservations
from jobs.schemas import JobKind, NodeInfo, Placement, Progress, WarmGroup
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


class BusyGroup(_Row):
    """A warm group running jobs now: its batch (continuous batching, jobs/warm_groups.py)."""

    group_id: str
    model: str
    strategy: str
    nodes: list[str]
    jobs: list[str]  # its batch: prefilling or decoding
    decoding: int  # of those, how many decode now


class Overview(_Row):
    taken_at: float
    queues: list[QueueRow]
    nodes: list[NodeInfo]
    reserved_bytes: dict[str, int]  # node -> bytes held by running groups' reservations
    running: list[RunningJob]
    idle_groups: list[IdleGroup] = []
    busy_groups: list[BusyGroup] = []
    queued: list[JobSummary] = []  # oldest first (the next to be placed), waiting_reason each
    queued_total: int = 0  # all queued jobs; `queued` holds the first QUEUED_SHOWN
    services: list[ServiceStatus] = []  # what `ringq up` supervises: state, restarts


QUEUED_SHOWN = 50


def take_overview(store: JobStore) -> Overview:
    """Queues (the admit queue, then every registered node's), live nodes, running jobs."""
    conn = store.conn
    nodes = store.live_nodes()
    running = running_jobs(conn)
    return Overview(
        taken_at=time.time(),
        queues=queue_rows(conn, [n.name for n in nodes]),
        nodes=nodes,
        reserved_bytes=reserved_per_node(conn, [n.name for n in nodes]),
        running=running,
        busy_groups=busy_groups(WarmGroups(conn), running),
        queued=oldest_queued(conn, QUEUED_SHOWN),
        queued_total=int(conn.zcard(keys.jobs_in_state(JobState.QUEUED))),
        idle_groups=[idle_group(warm) for warm in WarmGroups(conn).idle_groups()],
        services=read_service_statuses(conn),
    )


def idle_group(warm: WarmGroup) -> IdleGroup:
    group = warm.group
    return IdleGroup(
        group_id=group.group_id,
        model=group.model,
        strategy=group.strategy,
        nodes=group.nodes,
        bytes_per_node=warm.bytes_per_node,
    )


def busy_groups(warm: WarmGroups, running: list[RunningJob]) -> list[BusyGroup]:
    decoding = Counter(
        job.placement.group_id
        for job in running
        if job.state == JobState.DECODE and job.placement is not None
    )
    found = []
    for entry in warm.busy_groups():
        group = entry.group
        found.append(
            BusyGroup(
                group_id=group.group_id,
                model=group.model,
                strategy=group.strategy,
                nodes=group.nodes,
                jobs=warm.batch(group.group_id),
                decoding=decoding[group.group_id],
            )
        )
    return found


def reserved_per_node(conn: redis.Redis, names: list[str]) -> dict[str, int]:
    reservations = Reservations(conn, lease_s=0)  # read only: the lease length is not used
    return {name: reservations.reserved_bytes(name) for name in names}


def queue_rows(conn: redis.Redis, live_nodes: list[str] | None = None) -> list[QueueRow]:
    """The admit queue, then the queue of each live node (all registered ones when None)."""
    if live_nodes is None:
        live_nodes = sorted(_text(n) for n in conn.smembers(keys.NODES_INDEX))
    queues = [admit_queue(conn)] + [node_queue(conn, name) for name in sorted(live_nodes)]
    return [
        QueueRow(name=q.name, queued=q.count, started=q.started_job_registry.count) for q in queues
    ]


def running_jobs(conn: redis.Redis, chunk_jobs: int = SCAN_CHUNK_JOBS) -> list[RunningJob]:
    """Every job whose state is admitted, loading, prefill or decode, oldest first, from the
    per-state indexes."""
    ensure_state_indexes(conn)
    ids: set[str] = set()
    for state in RUNNING_STATES:
        ids.update(_text(i) for i in conn.zrange(keys.jobs_in_state(state), 0, -1))
    found: list[RunningJob] = []
    ordered = sorted(ids)
    for start in range(0, len(ordered), chunk_jobs):
        chunk = ordered[start : start + chunk_jobs]
        with conn.pipeline(transaction=False) as pipe:
            for job_id in chunk:
                pipe.hmget(keys.job(job_id), _RUNNING_FIELDS)
            rows = pipe.execute()
        found += [
            _running_job(i, r)
            for i, r in zip(chunk, rows, strict=True)
            if None not in r and _is_running(r[1])
        ]
    return sorted(found, key=lambda job: (job.created_at, job.id))


def oldest_queued(conn: redis.Redis, limit: int) -> list[JobSummary]:
    """The queued jobs that are placed next (oldest first), with why each waits."""
    ensure_state_indexes(conn)
    ids = [_text(i) for i in conn.zrange(keys.jobs_in_state(JobState.QUEUED), 0, limit - 1)]
    return summaries(conn, ids, JobState.QUEUED)


def _is_running(raw_state: bytes | str) -> bool:
    return JobState(json.loads(raw_state)) in RUNNING_STATES


def _running_job(job_id: str, raw: list[Any]) -> RunningJob:
    fields = dict(zip(_RUNNING_FIELDS, (json.loads(v) for v in raw), strict=True))
    progress = Progress.model_validate(fields["progress"])
    return RunningJob(id=job_id, eta_s=eta_s(progress), **{**fields, "progress": progress})


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
