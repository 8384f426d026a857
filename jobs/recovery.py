"""Lost groups and the jobs on them.

A group is lost when one of its ranks dies (an error, kill -9, a stall, a broken link) or one of
its nodes stops answering. Its job goes back to the admit queue for a new placement, at most
RINGQ_MAX_RETRIES times, then fails with every reason. Only the first report of a group acts:
the job's placement names its current group, and every write of a rank or of this module is
checked against it in the same transaction, so a lost group can never finish or fail a retry.

Node agents report the groups whose ranks they see exit. The reconciler (a thread of every
dispatcher) finds the rest: groups on nodes that stopped heartbeating, groups whose leases nobody
renews (ranks never started, agents died), and admissions a crashed dispatcher left behind.
"""

import logging
import threading
import time

import redis
from pydantic import ValidationError
from rq import Queue
from rq.registry import StartedJobRegistry

from jobs import keys
from jobs.errors import IllegalTransitionError, JobNotFoundError, StaleGroupError
from jobs.lifecycle import JobState
from jobs.schemas import (
    GroupFailure,
    GroupSpec,
    JobRecord,
    NodeInfo,
    Progress,
    TrackedGroup,
    WarmGroup,
)
from jobs.settings import Settings
from jobs.store import JobStore
from jobs.submit import admit_data, admit_queue
from jobs.workers import DISPATCHER_ROLE, died_here

log = logging.getLogger(__name__)
GROUP_FAILED_TTL_S = 3600
RECONCILE_INTERVAL_S = 1.0
STUCK_DEQUEUED_S = 5.0  # a live dispatcher starts what it dequeued within microseconds


def report_group_failure(conn: redis.Redis, group_id: str, reason: str, retry: bool) -> None:
    """Record why a group failed (the first report wins); node agents then stop its ranks."""
    value = GroupFailure(reason=reason, retry=retry).model_dump_json()
    conn.set(keys.group_failed(group_id), value, nx=True, ex=GROUP_FAILED_TTL_S)


def group_failure(conn: redis.Redis, group_id: str) -> GroupFailure | None:
    raw = conn.get(keys.group_failed(group_id))
    if raw is None:
        return None
    try:
        return GroupFailure.model_validate_json(raw)
    except ValidationError:
        return GroupFailure(
            reason=f"group {group_id} failed (unreadable failure record)", retry=False
        )


def lose_group(
    conn: redis.Redis,
    settings: Settings,
    job_id: str,
    group_id: str,
    reason: str,
    retry: bool = True,
) -> str | None:
    """Group `group_id` of job `job_id` is gone: stop its ranks, then place the job again or fail
    it once retries are spent. The first recorded failure's reason is used. Returns "retried",
    "failed", or None when the job had already moved on (ended, or retried by another caller)."""
    report_group_failure(conn, group_id, reason, retry)
    failure = group_failure(conn, group_id) or GroupFailure(reason=reason, retry=retry)
    conn.hdel(keys.GROUPS_INDEX, group_id)
    store = JobStore(conn, settings.job_ttl_s)
    try:
        record = store.get(job_id)
        if record.attempt < settings.max_retries and failure.retry:
            requeue(conn, store, record, group_id, failure.reason)
            log.warning("job %s: group %s lost, retrying: %s", job_id, group_id, failure.reason)
            return "retried"
        if not store.end(job_id, JobState.FAILED, final_reason(record, failure), group_id=group_id):
            return None
        log.warning("job %s failed: %s", job_id, failure.reason)
        return "failed"
    except (StaleGroupError, IllegalTransitionError, JobNotFoundError):
        return None


def requeue(
    conn: redis.Redis, store: JobStore, record: JobRecord, group_id: str, reason: str
) -> None:
    """Back to queued, and a new admission in the same transaction (nothing is left without one)."""
    attempt = record.attempt + 1
    retry_admission = admit_data(record.id, f"-attempt{attempt}")
    store.transition(
        record.id,
        JobState.QUEUED,
        group_id=group_id,
        also=lambda pipe: admit_queue(conn).enqueue_many([retry_admission], pipeline=pipe),
        attempt=attempt,
        retry_reasons=[*record.retry_reasons, reason],
        placement=None,
        waiting_reason=f"retry {attempt} after its group was lost: {reason}",
        progress=Progress(phase=JobState.QUEUED, total=record.progress.total),
    )


def final_reason(record: JobRecord, failure: GroupFailure) -> str:
    if not record.retry_reasons:
        return failure.reason
    earlier = "; ".join(f"{i + 1}: {r}" for i, r in enumerate(record.retry_reasons))
    return f"{failure.reason} (after {len(record.retry_reasons)} retries; earlier: {earlier})"


def retry_delay_s(settings: Settings) -> float:
    """The longest a retried job waits before placement: long enough for a dead node to go
    stale, so the new placement avoids it."""
    return stale_after_s(settings) + settings.node_heartbeat_s


def retry_waits(record: JobRecord, nodes: list[NodeInfo], settings: Settings) -> bool:
    """Whether a retried job still waits: while a node not heard from since the job went back
    to the queue is not yet stale (it may have died with the lost group), and at most
    `retry_delay_s`. A rank that died on a live node (killed, out of memory) is retried at the
    nodes' next heartbeats, not after a dead node's full timeout."""
    now, requeued = time.time(), record.updated_at
    if not record.attempt or now >= requeued + retry_delay_s(settings):
        return False
    return any(n.heartbeat_at < requeued for n in fresh_nodes(nodes, settings))


def stale_after_s(settings: Settings) -> float:
    """A node whose last heartbeat is older than this is treated as gone."""
    return min(settings.node_ttl_s, 2 * settings.node_heartbeat_s + 1)


def fresh_nodes(nodes: list[NodeInfo], settings: Settings) -> list[NodeInfo]:
    now = time.time()
    return [n for n in nodes if now - n.heartbeat_at <= stale_after_s(settings)]


def track_group(conn: redis.Redis, group: GroupSpec) -> None:
    """Watch a group from admission on (the reconciler drops it once its job moves on)."""
    entry = TrackedGroup(group=group, admitted_at=time.time())
    conn.hset(keys.GROUPS_INDEX, group.group_id, entry.model_dump_json())


def untrack_group(conn: redis.Redis, group_id: str) -> None:
    conn.hdel(keys.GROUPS_INDEX, group_id)


_FORGET_IF_UNCHANGED = """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then
  return redis.call('HDEL', KEYS[1], ARGV[1])
end
return 0
"""


def forget_group(conn: redis.Redis, group_id: str, seen: bytes | str) -> bool:
    """Stop watching a group whose job moved on, unless its entry changed since it was read
    as `seen`: a warm group handed its next job meanwhile is tracked again for that job."""
    return bool(conn.eval(_FORGET_IF_UNCHANGED, 1, keys.GROUPS_INDEX, group_id, seen))


def current_job(conn: redis.Redis, group_id: str, default: str) -> str:
    """The job a group was last given: a warm group runs one job after another."""
    raw = conn.hget(keys.GROUPS_INDEX, group_id)
    return TrackedGroup.model_validate_json(raw).group.job_id if raw else default


def group_job_ids(conn: redis.Redis, group_id: str, default: str) -> list[str]:
    """Every job a group runs now: the one it was last given and its batch (continuous
    batching: jobs that joined while it decoded), in a stable order."""
    batch = [m.decode() if isinstance(m, bytes) else str(m) for m in
             conn.hkeys(keys.group_batch(group_id))]  # fmt: skip
    return list(dict.fromkeys([current_job(conn, group_id, default), *sorted(batch)]))


def live_on_group(store: JobStore, job_ids: list[str], group_id: str) -> list[JobRecord]:
    """The records of `job_ids` that still run on `group_id` (not ended, not moved on)."""
    found = []
    for job_id in job_ids:
        try:
            record = store.get(job_id)
        except JobNotFoundError:
            continue
        placement = record.placement
        if not record.state.is_final and placement is not None and placement.group_id == group_id:
            found.append(record)
    return found


def lose_group_jobs(
    conn: redis.Redis, settings: Settings, group: GroupSpec, reason: str, retry: bool = True
) -> dict[str, str | None]:
    """lose_group for every job the group runs (a batch is retried whole, each job once:
    each retry is checked against the job's placement); job id -> outcome."""
    report_group_failure(conn, group.group_id, reason, retry)
    store = JobStore(conn, settings.job_ttl_s)
    job_ids = group_job_ids(conn, group.group_id, group.job_id)
    records = live_on_group(store, job_ids, group.group_id)
    if not records:  # nothing to retry; still drop the group from the index
        conn.hdel(keys.GROUPS_INDEX, group.group_id)
    outcomes = {
        r.id: lose_group(conn, settings, r.id, group.group_id, reason, retry) for r in records
    }
    conn.delete(keys.group_batch(group.group_id))  # each job is retried or failed now
    return outcomes


def has_live_lease(conn: redis.Redis, group: GroupSpec) -> bool:
    now = time.time()
    leases = [conn.zscore(keys.node_leases(n), group.group_id) for n in set(group.nodes)]
    return any(lease is not None and lease > now for lease in leases)


def forget_dead_warm_groups(conn: redis.Redis) -> None:
    for raw_id, raw in conn.hgetall(keys.WARM_GROUPS).items():
        group = WarmGroup.model_validate_json(raw).group
        if conn.exists(keys.group_failed(group.group_id)) or not has_live_lease(conn, group):
            conn.hdel(keys.WARM_GROUPS, raw_id)


def rescue_dequeued(queue: Queue) -> list[str]:
    """Admissions a dispatcher took off the queue and died before starting (RQ parks them in
    its intermediate list and looks again only every 10 minutes): back on the queue once seen
    there, not started, for STUCK_DEQUEUED_S."""
    parked = queue.intermediate_queue
    rescued = []
    for job_id in parked.get_job_ids():
        if job_id in queue.started_job_registry or parked.set_first_seen(job_id):
            continue
        first_seen = parked.get_first_seen(job_id)
        if first_seen and time.time() - first_seen.timestamp() > STUCK_DEQUEUED_S:
            parked.remove(job_id)
            queue.push_job_id(job_id)
            rescued.append(job_id)
            log.warning("admission %s was dequeued by a dispatcher that died: requeued", job_id)
    return rescued


def expire_admissions_of_dead_dispatchers(queue: Queue) -> list[str]:
    """An admission started by a dispatcher of this host whose process is gone is expired now,
    so the registry's cleanup retries it at once rather than after its timeout (RQ's only
    sign otherwise: ADMIT_TIMEOUT_S + HEARTBEAT_MARGIN_S, 65 s). Returns the admissions."""
    registry = queue.started_job_registry
    expired = []
    for member in registry.connection.zrange(registry.key, 0, -1):
        entry = member.decode() if isinstance(member, bytes) else str(member)
        job = queue.fetch_job(entry.split(":", 1)[0])
        if job is not None and job.worker_name and died_here(job.worker_name, DISPATCHER_ROLE):
            registry.connection.zadd(registry.key, {entry: 0}, xx=True)
            expired.append(job.id)
            log.warning("admission %s: its dispatcher (%s) died: retried", job.id, job.worker_name)
    return expired


def reconcile(conn: redis.Redis, settings: Settings) -> list[str]:
    """One pass; returns the ids of the groups it found lost."""
    forget_dead_warm_groups(conn)
    # Admissions whose dispatcher died mid-job: RQ retries them (admission is idempotent).
    queue = admit_queue(conn)
    expire_admissions_of_dead_dispatchers(queue)
    StartedJobRegistry(queue=queue).cleanup()
    rescue_dequeued(queue)
    store = JobStore(conn, settings.job_ttl_s)
    live = {n.name for n in fresh_nodes(store.live_nodes(), settings)}
    lost = []
    for raw_id, raw in conn.hgetall(keys.GROUPS_INDEX).items():
        group_id = raw_id.decode() if isinstance(raw_id, bytes) else str(raw_id)
        entry = TrackedGroup.model_validate_json(raw)
        group = entry.group
        running = live_on_group(store, group_job_ids(conn, group_id, group.job_id), group_id)
        if not running:
            # every job ended or moved on, or a dispatcher died between tracking the group and
            # admitting the job (RQ admits it again): a job whose admission is in flight is
            # left alone for a lease's time
            if not admission_in_flight(store, group.job_id, entry, settings):
                forget_group(conn, group_id, raw)
            continue
        reason = why_lost(conn, settings, group, live, entry.admitted_at)
        if reason is not None:
            for record in running:  # a batch: every job of it
                lose_group(conn, settings, record.id, group_id, reason)
            conn.delete(keys.group_batch(group_id))
            lost.append(group_id)
    return lost


def admission_in_flight(
    store: JobStore, job_id: str, entry: TrackedGroup, settings: Settings
) -> bool:
    try:
        record = store.get(job_id)
    except JobNotFoundError:
        return False
    recent = time.time() - entry.admitted_at <= settings.reservation_lease_s
    return not record.state.is_final and recent


def why_lost(
    conn: redis.Redis, settings: Settings, group: GroupSpec, live: set[str], admitted_at: float
) -> str | None:
    dead = sorted(set(group.nodes) - live)
    if dead:
        return (
            f"node {', '.join(dead)} stopped answering (no heartbeat for "
            f"{stale_after_s(settings):g} s) while it ran the job's group"
        )
    now = time.time()
    if now - admitted_at < settings.reservation_lease_s:
        return None
    if not has_live_lease(conn, group):
        return (
            f"no node agent renewed the group's lease for {settings.reservation_lease_s:g} s "
            "(its ranks never started or exited without a word)"
        )
    return None


class Reconciler:
    """reconcile() every RECONCILE_INTERVAL_S in a daemon thread; Redis errors are logged."""

    def __init__(self, conn: redis.Redis, settings: Settings):
        self.conn, self.settings = conn, settings
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="ringq-reconciler")

    def start(self) -> "Reconciler":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()

    def _run(self) -> None:
        while not self.stopping.wait(RECONCILE_INTERVAL_S):
            try:
                reconcile(self.conn, self.settings)
            except redis.RedisError as exc:
                log.warning("reconciler: %s", exc)
            except Exception:  # the dispatcher outlives any one bad record
                log.exception("reconciler pass failed")
