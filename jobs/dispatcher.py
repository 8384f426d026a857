"""The dispatcher: tokenise, estimate, place, ask node agents to start a ring group, hand over.

`admit_job` runs inside the dispatcher's RQ worker (no fork) for every submitted job."""

import logging
import sys
import time
import uuid
from typing import Literal

import redis
from rq import get_current_job

from admission.model_shape import ModelShape
from admission.placement import (
    CannotPlace,
    NodeCapacity,
    PlacementPlan,
    PlacementRequest,
    plan_placement,
)
from jobs import keys
from jobs.errors import AdmissionError, InvalidJobError, JobNotFoundError, RingqError
from jobs.lifecycle import JobState
from jobs.model_catalog import load_tokenizer, read_model_shape, resolve_model
from jobs.recovery import Reconciler, fresh_nodes, retry_delay_s, track_group
from jobs.reservations import Reservations
from jobs.schemas import GroupSpec, JobKind, JobRecord, JobSpec, NodeInfo, Placement, Progress
from jobs.settings import Settings, get_settings
from jobs.store import JobStore
from jobs.submit import admit_data, admit_queue, node_queue
from jobs.warm_groups import WarmGroups
from jobs.workers import service_worker

log = logging.getLogger(__name__)
CPU_COMPUTE_DTYPE = "float32"  # what CPU ranks compute in (ring_worker.rank_main)


def admit_job(job_id: str) -> str:
    """RQ entry point. Every outcome is written on the job record; nothing is raised to RQ."""
    job = get_current_job()
    assert job is not None, "admit_job runs inside the dispatcher's RQ worker"
    conn = job.connection
    store = JobStore(conn)
    try:
        return admit(conn, store, job_id, get_settings())
    except RingqError as exc:
        log.info("job %s rejected: %s", job_id, exc)
        store.fail(job_id, str(exc))
        return "failed"
    except Exception as exc:  # the dispatcher must outlive any one job
        log.exception("job %s: dispatcher error", job_id)
        store.fail(job_id, f"dispatcher error: {type(exc).__name__}: {exc}")
        return "failed"


def admit(conn: redis.Redis, store: JobStore, job_id: str, settings: Settings) -> str:
    record = store.get(job_id)
    if record.state != JobState.QUEUED:
        return f"skipped ({record.state})"
    if record.attempt and time.time() < record.updated_at + retry_delay_s(settings):
        # a retry: wait until a node that died with the lost group is no longer live
        return wait(conn, store, job_id, settings, record.waiting_reason or "retrying")
    spec = record.spec
    earlier = stored_tokens(store, job_id, record)
    tokens, shape = tokenize_and_check(spec, earlier)
    if earlier is None:  # stored once: ranks read them, and a retry need not tokenise again
        store.set_tokens(job_id, tokens)
    nodes = fresh_nodes(store.live_nodes(), settings)
    if spec.cache_from is not None:  # only the node that holds the cache will do
        holder = cache_node(store, spec)
        if holder is None:
            return wait(conn, store, job_id, settings, f"waiting for job {spec.cache_from}")
        nodes = [n for n in nodes if n.name == holder]
        if not nodes:
            reason = f"waiting for node {holder}, which holds job {spec.cache_from}'s KV cache"
            return wait(conn, store, job_id, settings, reason)
    if not nodes and (known := conn.scard(keys.NODES_INDEX)):
        reason = f"no node agent is live right now ({known} registered before): waiting for one"
        return wait(conn, store, job_id, settings, reason)
    request = PlacementRequest(
        prompt_tokens=len(tokens),
        max_new_tokens=new_tokens(spec),
        chunk_tokens=settings.prefill_chunk_tokens,
        ring_size=None if spec.ring_size == "auto" else spec.ring_size,
        sharding="single" if spec.keep_cache or spec.cache_from else spec.sharding.value,
        # A retry runs on the fewest nodes that fit: a lost group may have been a broken link.
        ring_min_tokens=sys.maxsize if record.attempt else settings.ring_min_tokens,
        kv_layout=settings.decode_kv,
    )
    reservations = Reservations(conn, settings.reservation_lease_s)
    warm = WarmGroups(conn)
    idle = warm.idle() if settings.group_idle_s > 0 else []
    free = [capacity(n, reservations.reserved_bytes(n.name)) for n in nodes]
    if idle and (
        done := try_warm(conn, store, job_id, settings, shape, request, nodes, idle, warm)
    ):
        return done
    try:
        plan = plan_placement(shape, request, free)
    except CannotPlace as busy:
        try:  # would it fit once the running groups are done?
            plan_placement(shape, request, [capacity(n) for n in nodes])
        except CannotPlace as never:
            raise AdmissionError(str(never)) from None
        if asked := warm.evict(group for group, _ in idle):
            log.info("job %s: asked idle groups %s to make way", job_id, asked)
        reason = f"waiting for memory that running groups hold: {busy}"
        return wait(conn, store, job_id, settings, reason)
    by_name = {n.name: n for n in nodes}
    group_id = uuid.uuid4().hex[:12]
    needs = {name: (plan.bytes_per_node, by_name[name].memory_bytes) for name in plan.nodes}
    if (why := reservations.reserve(group_id, needs)) is not None:
        return wait(conn, store, job_id, settings, why)  # another dispatcher was faster
    try:
        return hand_over(conn, store, job_id, settings, plan, by_name, group_id, len(tokens))
    except BaseException:
        for name in plan.nodes:
            reservations.release(group_id, name)
        raise


def serve(conn: redis.Redis, settings: Settings) -> None:
    """The dispatcher service: admissions from the admit queue, and the reconciler alongside."""
    reconciler = Reconciler(conn, settings).start()
    try:
        service_worker(admit_queue(conn), conn, "dispatcher").work(logging_level="WARNING")
    finally:
        reconciler.stop()


def try_warm(
    conn: redis.Redis,
    store: JobStore,
    job_id: str,
    settings: Settings,
    shape: ModelShape,
    request: PlacementRequest,
    nodes: list[NodeInfo],
    idle: list[tuple[GroupSpec, int]],
    warm: WarmGroups,
) -> str | None:
    """Give the job to an idle group with the layout it would get if idle groups made way and
    the same model and settings, growing the group's reservation if the job needs more. None
    when there is no such group."""
    spec = store.get(job_id).spec
    freed = {group.group_id: held for group, held in idle}
    reservations = Reservations(conn, settings.reservation_lease_s)
    by_name = {n.name: n for n in nodes}
    idle_held = {n.name: sum(held for g, held in idle if n.name in g.nodes) for n in nodes}
    free = [capacity(n, reservations.reserved_bytes(n.name) - idle_held[n.name]) for n in nodes]
    try:
        plan = plan_placement(shape, request, free)
    except CannotPlace:
        return None
    for group, held in idle:
        if not runs_like(group, spec, plan, settings, by_name):
            continue
        if held < plan.bytes_per_node:  # grow its reservation, or leave it be
            needs = {n: (plan.bytes_per_node, by_name[n].memory_bytes) for n in group.nodes}
            if reservations.reserve(group.group_id, needs) is not None:
                continue
            freed[group.group_id] = plan.bytes_per_node
        placement = Placement(
            strategy=group.strategy,
            kv_layout=group.decode_kv,
            ring_size=len(group.nodes),
            nodes=list(group.nodes),
            group_id=group.group_id,
            bytes_per_node=freed[group.group_id],
            warm=True,
        )
        progress = Progress(phase=JobState.ADMITTED, total=request.prompt_tokens)
        store.transition(
            job_id, JobState.ADMITTED, placement=placement, progress=progress, waiting_reason=None
        )
        if warm.claim(group, job_id):
            track_group(conn, group.model_copy(update={"job_id": job_id}))
            log.info("job %s admitted to warm group %s", job_id, group.group_id)
            return "admitted (warm)"
        # another dispatcher took it, or it just retired: back to queued, try the next
        store.transition(job_id, JobState.QUEUED, placement=None)
    return None


def runs_like(
    group: GroupSpec,
    spec: JobSpec,
    plan: PlacementPlan,
    settings: Settings,
    live: dict[str, NodeInfo],
) -> bool:
    """Whether `group` is what a fresh group for this job and plan would be."""
    if not all(n in live for n in group.nodes):
        return False
    return (
        group.model == spec.model
        and group.strategy == plan.layout.strategy
        and len(group.nodes) == plan.layout.size
        and group.decode_kv == plan.layout.kv_layout
        and group.chunk_tokens == settings.prefill_chunk_tokens
        and group.exchange == choose_exchange(settings, [live[n] for n in group.nodes])
    )


def hand_over(
    conn: redis.Redis,
    store: JobStore,
    job_id: str,
    settings: Settings,
    plan: PlacementPlan,
    by_name: dict[str, NodeInfo],
    group_id: str,
    prompt_tokens: int,
) -> str:
    """Record the placement and ask each node agent to start its rank of the group."""
    spec = store.get(job_id).spec
    group = GroupSpec(
        group_id=group_id,
        job_id=job_id,
        model=spec.model,
        addresses=[allocate_address(conn, by_name[name], settings) for name in plan.nodes],
        nodes=list(plan.nodes),
        chunk_tokens=settings.prefill_chunk_tokens,
        strategy=plan.layout.strategy,
        exchange=choose_exchange(settings, [by_name[name] for name in plan.nodes]),
        decode_kv=plan.layout.kv_layout,
        idle_s=settings.group_idle_s,
    )
    placement = Placement(
        strategy=plan.layout.strategy,
        kv_layout=plan.layout.kv_layout,
        ring_size=len(plan.nodes),
        nodes=list(plan.nodes),
        group_id=group.group_id,
        bytes_per_node=plan.bytes_per_node,
    )
    progress = Progress(phase=JobState.ADMITTED, total=prompt_tokens)
    store.transition(
        job_id, JobState.ADMITTED, placement=placement, progress=progress, waiting_reason=None
    )
    track_group(conn, group)
    for rank, name in enumerate(group.nodes):
        node_queue(conn, name).enqueue(
            "ring_worker.node_agent.start_rank",
            group.model_dump(mode="json"),
            rank,
            job_timeout=60,
            result_ttl=600,
        )
    log.info("job %s admitted: %s on %s", job_id, plan.layout.label, placement.nodes)
    return "admitted"


def wait(conn: redis.Redis, store: JobStore, job_id: str, settings: Settings, reason: str) -> str:
    """The job fits once running groups free memory: it stays queued (saying why) and tries
    again after the jobs queued behind it, so smaller jobs that fit now go first (backfill)."""
    store.set_waiting(job_id, reason)
    queue = admit_queue(conn)
    time.sleep(settings.admit_retry_s / (1 + queue.count))  # a round over all waiting jobs
    attempt = int(conn.incr(keys.admit_retries(job_id)))
    conn.expire(keys.admit_retries(job_id), settings.job_ttl_s)
    queue.enqueue_many([admit_data(job_id, f"-wait{attempt}")])
    log.info("job %s waits for memory: %s", job_id, reason)
    return "waiting"


def cache_node(store: JobStore, spec: JobSpec) -> str | None:
    """The node holding the KV cache `spec` starts from; None while that prefill job runs.
    InvalidJobError when there is no such cache to use."""
    source_id = spec.cache_from
    assert source_id is not None
    try:
        source = store.get(source_id)
    except JobNotFoundError:
        raise InvalidJobError(f"cache_from: no job {source_id!r}") from None
    if not source.spec.keep_cache:
        raise InvalidJobError(
            f"cache_from: job {source_id} did not keep its KV cache (submit it with keep_cache)"
        )
    if source.spec.model != spec.model:
        raise InvalidJobError(
            f"cache_from: job {source_id} ran {source.spec.model}, this job asks for {spec.model}"
        )
    if not source.state.is_final:
        return None
    if source.state != JobState.FINISHED or source.placement is None:
        raise InvalidJobError(f"cache_from: job {source_id} is {source.state}, it kept no cache")
    return source.placement.nodes[0]


def stored_tokens(store: JobStore, job_id: str, record: JobRecord) -> list[int] | None:
    """Tokens an earlier attempt stored for a job that waited for memory."""
    if record.waiting_reason is None:
        return None
    try:
        return store.get_tokens(job_id)
    except JobNotFoundError:
        return None


def tokenize_and_check(
    spec: JobSpec, tokens: list[int] | None = None
) -> tuple[list[int], ModelShape]:
    """The job's prompt tokens (given ones are reused) and its model's shape; InvalidJobError
    past the model's context."""
    tokens = prompt_tokens(spec) if tokens is None else tokens
    shape = read_model_shape(resolve_model(spec.model), dtype=CPU_COMPUTE_DTYPE)
    if len(tokens) + new_tokens(spec) > shape.context_length:
        raise InvalidJobError(
            f"prompt of {len(tokens)} tokens (+{new_tokens(spec)} to generate) exceeds "
            f"{spec.model}'s context of {shape.context_length} tokens; shorten the document"
        )
    return tokens, shape


def new_tokens(spec: JobSpec) -> int:
    return spec.max_tokens if spec.kind == JobKind.GENERATE else 0


def prompt_tokens(spec: JobSpec) -> list[int]:
    tokenizer = load_tokenizer(resolve_model(spec.model))
    if spec.kind == JobKind.PREFILL and spec.keep_cache:
        # as a generate job's prompt begins: its cache then serves questions on this document
        return tokenizer.chat_tokens([{"role": "user", "content": spec.document.rstrip()}])
    if spec.kind == JobKind.PREFILL:
        return tokenizer.encode(spec.document)
    message = "\n\n".join(part for part in (spec.document.rstrip(), spec.prompt_text()) if part)
    return tokenizer.chat_tokens([{"role": "user", "content": message}])


def choose_exchange(settings: Settings, nodes: list[NodeInfo]) -> Literal["rotate", "allgather"]:
    """All-gather on CUDA groups (MLX's NCCL backend has no send/recv; NCCL all_gather moved
    98 GB/s vs 3 GB/s for ring send/recv on 2xH200), rotation elsewhere."""
    if settings.exchange != "auto":
        return settings.exchange
    return "allgather" if all(n.backend == "cuda" for n in nodes) else "rotate"


def capacity(node: NodeInfo, reserved_bytes: int = 0) -> NodeCapacity:
    """What admission may still promise on `node`: its budget less what running groups hold."""
    free = node.memory_bytes - reserved_bytes
    return NodeCapacity(node.name, free, dense_weights=node.backend == "cpu")


def allocate_address(conn: redis.Redis, node: NodeInfo, settings: Settings) -> str:
    """A port for one rank on `node`: a counter per address walks the configured span."""
    seq = int(conn.incr(keys.ports(node.address)))
    return f"{node.address}:{settings.rank_port_base + seq % settings.rank_port_span}"
