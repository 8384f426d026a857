"""The dispatcher: read a job and the cluster once, plan (jobs.admit_plan, pure), then commit:
reserve memory, record the placement, and hand the job to a warm group or ask node agents to
start a new one.

`admit_job` runs inside the dispatcher's RQ worker (no fork) for every submitted job."""

import dataclasses
import logging
import time
import uuid

import redis
from rq import get_current_job

from jobs import keys
from jobs.admit_plan import (
    Cluster,
    Job,
    Join,
    Place,
    Wait,
    join_budgets,
    plan_admission,
    plan_joins,
)
from jobs.checkpoint_marks import checkpoint_hint, read_marks
from jobs.errors import InvalidJobError, JobNotFoundError, RingqError
from jobs.lifecycle import JobState
from jobs.memory_waits import MemoryWaits
from jobs.model_catalog import default_dtype, resolve_model
from jobs.prefix_cache import (
    PENDING_GRACE_S,
    PENDING_TTL_S,
    PrefixHint,
    wait_for_pending,
    worth_keeping,
)
from jobs.prefix_index import PendingPrefixes, model_key, read_hint
from jobs.prompts import tokenize_and_check
from jobs.recovery import Reconciler, fresh_nodes, retry_waits, track_group, untrack_group
from jobs.reservations import Reservations
from jobs.schemas import GroupSpec, JobKind, JobRecord, JobSpec, NodeInfo, Placement, Progress
from jobs.settings import Settings, get_settings, group_batch_limit
from jobs.store import JobStore
from jobs.submit import admit_data, admit_queue, node_queue
from jobs.warm_groups import WarmGroups
from jobs.workers import DISPATCHER_ROLE, service_worker

log = logging.getLogger(__name__)
_dispatcher: "Dispatcher | None" = None  # one per dispatcher process, built on first use


def admit_job(job_id: str, wake: bool = False) -> str:
    """RQ entry point. Every outcome is written on the job record; nothing is raised to RQ.
    `wake`: an extra try of the head, as room freed (`Dispatcher.wait`)."""
    global _dispatcher
    job = get_current_job()
    assert job is not None, "admit_job runs inside the dispatcher's RQ worker"
    if _dispatcher is None or _dispatcher.conn is not job.connection:
        _dispatcher = Dispatcher(job.connection, get_settings())
    return _dispatcher.admit_guarded(job_id, again=not wake)


def serve(conn: redis.Redis, settings: Settings) -> None:
    """The dispatcher service: admissions from the admit queue, and the reconciler alongside."""
    global _dispatcher
    _dispatcher = Dispatcher(conn, settings)
    import_tokenizers()
    reconciler = Reconciler(conn, settings).start()
    try:
        service_worker(admit_queue(conn), conn, DISPATCHER_ROLE).work(logging_level="WARNING")
    finally:
        reconciler.stop()


def import_tokenizers() -> None:
    """Import what tokenising needs before the first job (5 s of its admission otherwise).
    Not in a thread: transformers' lazy imports fail when two threads import it at once."""
    import transformers.tokenization_utils_fast  # noqa: F401


class Dispatcher:
    """Owns its connection, store, settings and Redis scripts; built once per worker."""

    def __init__(self, conn: redis.Redis, settings: Settings):
        self.conn = conn
        self.settings = settings
        self.store = JobStore(conn, settings.job_ttl_s)
        self.reservations = Reservations(conn, settings.reservation_lease_s)
        self.warm = WarmGroups(conn)
        self.queue = admit_queue(conn)
        self.memory_waits = MemoryWaits(conn)

    def admit_guarded(self, job_id: str, again: bool = True) -> str:
        """admit(), with every failure recorded on the job: the dispatcher outlives any job."""
        try:
            return self.admit(job_id, again)
        except RingqError as exc:
            log.info("job %s rejected: %s", job_id, exc)
            self.store.fail(job_id, str(exc))
        except Exception as exc:
            log.exception("job %s: dispatcher error", job_id)
            self.store.fail(job_id, f"dispatcher error: {type(exc).__name__}: {exc}")
        self.memory_waits.drop(job_id)  # a failed head holds nothing
        return "failed"

    def admit(self, job_id: str, again: bool = True) -> str:
        """`again`: a job that waits tries again later (False for a wake's extra try: the
        job's own retry is still queued)."""
        record = self.store.get(job_id)
        if record.state != JobState.QUEUED:
            self.memory_waits.drop(job_id)
            return f"skipped ({record.state})"
        if record.attempt and retry_waits(record, self.store.live_nodes(), self.settings):
            return self.wait(record, Wait(record.waiting_reason or "retrying"), again)
        job = self.prepare(record)
        cluster = self.read_cluster(record)
        if isinstance(cluster, Wait):
            return self.wait(record, cluster, again)
        if (joined := self.try_join(job, cluster)) is not None:
            return joined
        decision = plan_admission(job, cluster, self.settings)
        if isinstance(decision, Wait):
            if decision.hold is None:  # waits for something other than memory: holds nothing
                self.memory_waits.drop(record.id)
            else:
                self.memory_waits.record(record, decision.hold)
            return self.wait(record, decision, again)
        return self.commit(job, decision, {n.name: n for n in cluster.nodes}, again)

    # -- reading

    def prepare(self, record: JobRecord) -> Job:
        """Tokenise once (a job that waited reuses its tokens) and check the context."""
        earlier = self.stored_tokens(record)
        allowed_dirs = self.settings.allowed_dirs
        tokens, shape = tokenize_and_check(record.spec, earlier, allowed_dirs=allowed_dirs)
        if earlier is None:  # stored once: ranks read them, and a retry need not tokenise again
            self.store.set_tokens(record.id, tokens)
        dtype = default_dtype(resolve_model(record.spec.model, allowed_dirs=allowed_dirs))
        # a retry: where an earlier attempt's checkpoint lies, to continue from it there
        checkpoint = checkpoint_hint(read_marks(self.conn, record.id)) if record.attempt else None
        return Job(record, tokens, shape, dtype, self.prefix_hint(record, tokens), checkpoint)

    def prefix_hint(self, record: JobRecord, tokens: list[int]) -> PrefixHint:
        """Where the job's prompt prefix is kept or being prefilled (automatic prefix reuse)."""
        if self.settings.prefix_cache == "off" or record.spec.cache_from is not None:
            return PrefixHint()
        return read_hint(self.conn, record.spec.model, tokens, record.id, self.ended)

    def ended(self, job_id: str) -> bool:
        """Whether a job's in-flight marks are stale: it failed or was cancelled, or finished
        more than PENDING_GRACE_S ago (its ranks clear them once its KV is kept)."""
        try:
            record = self.store.get(job_id)
        except JobNotFoundError:
            return True
        if record.state != JobState.FINISHED:
            return record.state.is_final
        return time.time() - record.updated_at > PENDING_GRACE_S

    def stored_tokens(self, record: JobRecord) -> list[int] | None:
        """Tokens an earlier attempt stored for a job that waited for memory."""
        if record.waiting_reason is None:
            return None
        try:
            return self.store.get_tokens(record.id)
        except JobNotFoundError:
            return None

    def read_cluster(self, record: JobRecord) -> Cluster | Wait:
        spec = record.spec
        nodes = fresh_nodes(self.store.live_nodes(), self.settings)
        if spec.cache_from is not None:  # only the node that holds the cache will do
            holder = self.cache_node(spec)
            if holder is None:
                return Wait(f"waiting for job {spec.cache_from}")
            nodes = [n for n in nodes if n.name == holder]
            if not nodes:
                return Wait(
                    f"waiting for node {holder}, which holds job {spec.cache_from}'s KV cache"
                )
        warm = self.settings.group_idle_s > 0
        return Cluster(
            nodes=nodes,
            held={n.name: self.reservations.held(n.name) for n in nodes},
            idle=self.warm.idle() if warm else [],
            waiting_jobs=self.queue.count,
            known_nodes=int(self.conn.scard(keys.NODES_INDEX)),
            busy=self.warm.busy_groups() if warm and spec.kind == JobKind.GENERATE else [],
            head=self.memory_waits.head(record),  # the queue order, read once
        )

    def cache_node(self, spec: JobSpec) -> str | None:
        """The node holding the KV cache `spec` starts from; None while that prefill job runs.
        InvalidJobError when there is no such cache to use."""
        source_id = spec.cache_from
        assert source_id is not None
        try:
            source = self.store.get(source_id)
        except JobNotFoundError:
            raise InvalidJobError(f"cache_from: no job {source_id!r}") from None
        if not source.spec.keep_cache:
            raise InvalidJobError(
                f"cache_from: job {source_id} did not keep its KV cache (submit it with keep_cache)"
            )
        if source.spec.model != spec.model:
            raise InvalidJobError(
                f"cache_from: job {source_id} ran {source.spec.model}, this job asks for "
                f"{spec.model}"
            )
        if not source.state.is_final:
            return None
        if source.state != JobState.FINISHED or source.placement is None:
            raise InvalidJobError(
                f"cache_from: job {source_id} is {source.state}, it kept no cache"
            )
        return source.placement.nodes[0]

    # -- committing

    def try_join(self, job: Job, cluster: Cluster | Wait) -> str | None:
        """Continuous batching: hand a generate job to a busy group of its model and layout
        with a free row, growing the group's reservation by the job's KV (one script: refused
        when a node's budget cannot hold it). None: no group took it (the usual paths)."""
        if isinstance(cluster, Wait) or not cluster.busy:
            return None
        if wait_for_pending(job.prefix, len(job.tokens)) is not None:
            # Its prefix is being prefilled. In a batch group it joins that group, which
            # prefills its joiners in turn: it starts from the first one's row. Waiting
            # instead let later jobs take the batch's rows, and by its turn the prefix had
            # left with its row. Elsewhere it waits (plan_admission says so).
            pending = job.prefix.pending_job
            busy = [w for w in cluster.busy if pending in self.warm.batch(w.group.group_id)]
            if not busy:
                return None
            cluster = dataclasses.replace(cluster, busy=busy)
        budget = join_budgets(job, cluster)  # less what is held for an older waiting job
        for join in plan_joins(job, cluster, self.settings):
            group = join.group.model_copy(update={"job_id": job.record.id})
            capacity = {name: budget[name] for name in group.nodes}
            outcome = self.warm.join(
                group, job.record.id, join.max_batch, join.grow_bytes, capacity, job.batch_row
            )
            log.info("job %s: join group %s: %s", job.record.id, group.group_id, outcome)
            if outcome == "joined":
                return self.admit_joined(job, join, group)
        return None

    def admit_joined(self, job: Job, join: Join, group: GroupSpec) -> str:
        """Record a job handed to a busy group (its ranks wait for this record)."""
        members = len(self.warm.batch(group.group_id))
        place = Place(
            join.plan,
            join.held_bytes + join.grow_bytes,
            f"joined the decode batch of group {group.group_id} ({members} jobs)",
            reuse=group,
            held_bytes=join.held_bytes,
        )
        track_group(self.conn, group)  # the reconciler watches its batch (jobs/recovery.py)
        self.store.transition(
            job.record.id,
            JobState.ADMITTED,
            placement=self.placement(group, place),
            progress=Progress(phase=JobState.ADMITTED, total=len(job.tokens)),
            waiting_reason=None,
        )  # cancelled meanwhile: raises; its group skips it and gives its bytes back
        self.memory_waits.drop(job.record.id)
        self.mark_pending_prefix(job)
        log.info("job %s admitted: %s", job.record.id, place.reason)
        return "admitted (joined)"

    def commit(self, job: Job, place: Place, nodes: dict[str, NodeInfo], again: bool = True) -> str:
        """Reserve, record the placement, then hand over: one path for warm and new groups."""
        job_id = job.record.id
        group = place.reuse or self.new_group(job, place, nodes)
        reserving = place.reuse is None or place.held_bytes < place.bytes_per_node
        if reserving:
            needs = {n: (place.bytes_per_node, nodes[n].memory_bytes) for n in group.nodes}
            if (why := self.reservations.reserve(group.group_id, needs)) is not None:
                return self.wait(job.record, Wait(why), again)  # another dispatcher was faster
        if place.reuse is not None and not self.warm.claim(group, job_id):
            # it retired or another dispatcher took it: nothing was recorded, try again soon
            if reserving and not self.conn.hexists(keys.WARM_GROUPS, group.group_id):
                self.release(group)  # retired: no agent renews what was just reserved for it
            retired = Wait("the warm group it was given retired; retrying")
            return self.wait(job.record, retired, again)
        placement = self.placement(group, place)
        progress = Progress(phase=JobState.ADMITTED, total=len(job.tokens))
        # Tracked before the job is ADMITTED: a dispatcher killed in between leaves a queued job
        # that RQ admits again, never an admitted job whose group nobody watches.
        track_group(self.conn, group.model_copy(update={"job_id": job_id}))
        self.warm.started(group, job_id, job.batch_row)  # what a lost group's retry covers
        try:
            self.store.transition(
                job_id,
                JobState.ADMITTED,
                placement=placement,
                progress=progress,
                waiting_reason=None,
            )
        except RingqError:  # cancelled meanwhile; a warm group skips the job it was given
            self.warm.ended(group, job_id)
            if place.reuse is None:
                self.release(group)
                untrack_group(self.conn, group.group_id)
            raise
        self.memory_waits.drop(job_id)  # placed: a head's hold ends
        self.mark_pending_prefix(job)
        if place.reuse is None:
            self.offer(group, place)
            self.start_ranks(group)
        log.info(
            "job %s admitted: %s on %s (%s)",
            job_id,
            place.plan.layout.label,
            placement.nodes,
            place.reason,
        )
        return "admitted (warm)" if place.reuse is not None else "admitted"

    def offer(self, group: GroupSpec, place: Place) -> None:
        """A new group that batches is offered once its job is admitted, so jobs join it while
        it starts. Its ranks then start and serve what joined even if that job is cancelled
        before they load (ring_worker/runtime/serve_loop.py `start_engine`, the node agents'
        `stale`)."""
        if group_batch_limit(group, self.settings) > 1:
            self.warm.offer(group, place.bytes_per_node, place.plan.chunk_tokens)

    def mark_pending_prefix(self, job: Job) -> None:
        """Later jobs on the same document wait for this prefill (its ranks clear the marks)."""
        if self.settings.prefix_cache == "on" and worth_keeping(
            len(job.tokens), job.prefix.kept_tokens
        ):
            PendingPrefixes(self.conn, PENDING_TTL_S).mark(
                job.record.id, model_key(job.record.spec.model), job.tokens
            )

    def new_group(self, job: Job, place: Place, nodes: dict[str, NodeInfo]) -> GroupSpec:
        return GroupSpec.from_plan(
            place.plan,
            group_id=uuid.uuid4().hex[:12],
            job_id=job.record.id,
            model=job.record.spec.model,
            addresses=[self.allocate_address(nodes[name]) for name in place.plan.nodes],
            idle_s=self.settings.group_idle_s,
        )

    @staticmethod
    def placement(group: GroupSpec, place: Place) -> Placement:
        return Placement(
            strategy=group.strategy,
            kv_layout=group.kv_layout,
            ranks=group.ranks,
            nodes=list(group.nodes),
            group_id=group.group_id,
            bytes_per_node=max(place.bytes_per_node, place.held_bytes),
            job_bytes_per_node=place.job_bytes_per_node or place.bytes_per_node,
            warm=place.reuse is not None,
            reason=place.reason,
            chunk_tokens=place.plan.chunk_tokens,
            devices=list(group.devices),
        )

    def start_ranks(self, group: GroupSpec) -> None:
        for rank, name in enumerate(group.nodes):
            node_queue(self.conn, name).enqueue(
                "ring_worker.runtime.node_agent.start_rank",
                group.model_dump(mode="json"),
                rank,
                job_timeout=60,
                result_ttl=600,
            )

    def release(self, group: GroupSpec) -> None:
        for name in group.nodes:
            self.reservations.release(group.group_id, name)

    def wait(self, record: JobRecord, wait: Wait, again: bool = True) -> str:
        """The job fits once running groups free memory: it stays queued (saying why) and tries
        again after the jobs queued behind it, so smaller jobs that fit now go first (backfill,
        jobs/admit_plan.py). The pause ends early when room frees (`wake_admissions`)."""
        if wait.evict and (asked := self.warm.evict(wait.evict)):
            log.info("job %s: asked idle groups %s to make way", record.id, asked)
        self.store.set_waiting(record.id, wait.reason)
        # a round over all; at least 1 ms: Redis reads a BLPOP timeout under that as 0, for ever
        pause_s = max(0.001, self.settings.admit_retry_s / (1 + self.queue.count))
        woken = self.conn.blpop([keys.ADMIT_WAKE], timeout=pause_s) is not None
        if again:
            self.queue.enqueue_many([admit_data(record.id, self.attempt_name(record.id, "wait"))])
        if woken and (head := self.memory_waits.first()) is not None:
            wake = admit_data(head, self.attempt_name(head, "wake"), wake=True)
            self.queue.enqueue_many([wake])
        # once per reason: a job waiting a minute is tried hundreds of times
        changed = record.waiting_reason != wait.reason
        log.log(logging.INFO if changed else logging.DEBUG, "job %s waits: %s", record.id,
                wait.reason)  # fmt: skip
        return "waiting"

    def attempt_name(self, job_id: str, what: str) -> str:
        """The suffix of a job's next admission's RQ id (one counter per job)."""
        attempt = int(self.conn.incr(keys.admit_retries(job_id)))
        self.conn.expire(keys.admit_retries(job_id), self.settings.job_ttl_s)
        return f"-{what}{attempt}"

    def allocate_address(self, node: NodeInfo) -> str:
        """A port for one rank on `node`: a counter per address walks the configured span."""
        seq = int(self.conn.incr(keys.ports(node.address)))
        return f"{node.address}:{self.settings.rank_port_base + seq % self.settings.rank_port_span}"
