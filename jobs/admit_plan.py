"""The dispatcher's plan step (pure): from one read of the job and of the cluster, Place or Wait;
a job that can never fit raises AdmissionError (Reject). jobs/dispatcher.py commits the result.

How a layout is chosen (the reason is stored on the placement and shown by `ringq status`):
- a prompt shorter than RINGQ_RING_MIN_TOKENS, a retry, or a backlog on GPUs (at least as many
  jobs waiting as free GPUs) takes the fewest nodes that fit: a ring of N finishes one job about
  0.95 N times faster than one GPU, so N jobs side by side clear a backlog sooner;
- otherwise a long prompt takes as many nodes as fit (a lone 128K job rings);
- a retry whose checkpoint's nodes are all live goes back to them, in the checkpoint's layout and
  rank order, unless a multi-node group stalled (that may have been a cut link between them);
- a kept prefix (jobs/prefix_cache.py): the job waits for an in-flight prefill of the same prefix
  (`wait_for_pending`), prefers the nodes that keep it but never waits for them (a recompute is
  bounded by one prefill), and only the tokens left to compute count against
  RINGQ_RING_MIN_TOKENS;
- continuous batching (RINGQ_MAX_BATCH > 1): a generate job first tries to join a busy group of
  its model and layout (`plan_joins`). Here a group takes it only while its batch is under
  settings.group_batch_limit and its nodes can grow the reservation by the job's row; the commit
  (jobs/warm_groups.py) may still refuse, and the lead rank takes it between decode steps
  (ring_worker/runtime/batch_serve.py `agreed_joins`);
- the head of the queue (EASY backfill, as in Slurm): the oldest job waiting for memory (it fits
  an empty cluster, not the cluster now; jobs/memory_waits.py) holds what it needs on the nodes it
  waits for (`Wait.hold`). To a later job the hold is a group of its own there
  (jobs/head_hold.py), so a GPU the head waits for runs nothing else and a later job joins a
  running group only where the head keeps its bytes and a slot. The head plans as if no hold
  were there; the hold keeps to the nodes it first took and ends when its job is placed, fails
  or is cancelled. Jobs waiting for a prefix's prefill, for nodes to come back or for idle groups
  to make way hold nothing."""

import sys
from dataclasses import dataclass, field, replace

from admission.estimate import BatchRow, Layout, batch_row_bytes
from admission.group_plan import GroupPlan, NodeFacts, chunk_candidates, plan_group
from admission.model_shape import ModelShape
from admission.placement import CannotPlace, NodeCapacity, PlacementRequest, plan_placement
from admission.vocabulary import DTYPE_BYTES
from jobs.checkpoint_marks import CheckpointHint
from jobs.errors import AdmissionError
from jobs.head_hold import HeadHold
from jobs.prefix_cache import PrefixHint, wait_for_pending
from jobs.schemas import GroupSpec, JobKind, JobRecord, NodeInfo, WarmGroup
from jobs.settings import Settings, group_batch_limit


@dataclass(frozen=True)
class Job:
    """A job ready to plan: its record (read once), prompt tokens and model facts."""

    record: JobRecord
    tokens: list[int]
    shape: ModelShape  # in float32 (CPU); GPUs plan in `model_dtype`
    model_dtype: str
    prefix: PrefixHint = PrefixHint()  # its kept / in-flight prefix (jobs/prefix_cache.py)
    checkpoint: CheckpointHint | None = None  # an earlier attempt's (jobs/checkpoint_marks.py)

    @property
    def new_tokens(self) -> int:
        spec = self.record.spec
        return spec.max_tokens if spec.kind == JobKind.GENERATE else 0

    @property
    def batch_row(self) -> BatchRow:
        """Its row of a decode batch (jobs/warm_groups.py)."""
        return BatchRow(len(self.tokens), self.new_tokens)


@dataclass(frozen=True)
class Cluster:
    """What the dispatcher read of the cluster for this admission."""

    nodes: list[NodeInfo]  # live, fresh ones (only the cache holder for cache_from jobs)
    held: dict[str, dict[str, int]]  # node -> group id -> reserved bytes
    idle: list[tuple[GroupSpec, int]]  # warm groups waiting for a job, with bytes they hold
    waiting_jobs: int = 0  # other admissions queued behind this one
    known_nodes: int = 0  # ever registered (to tell "none yet" from "all gone")
    busy: list[WarmGroup] = field(default_factory=list)  # running groups a job may join
    head: HeadHold | None = None  # the oldest job waiting for memory (older than this one)


@dataclass(frozen=True)
class Place:
    plan: GroupPlan
    bytes_per_node: int
    reason: str
    reuse: GroupSpec | None = None  # an idle warm group of this plan's shape
    held_bytes: int = 0  # what `reuse` holds per node now
    job_bytes_per_node: int | None = None  # the job's own need, when bytes_per_node is more


@dataclass(frozen=True)
class Wait:
    reason: str
    evict: list[GroupSpec] = field(default_factory=list)  # idle groups asked to make way
    hold: dict[str, int] | None = None  # waiting for memory: node -> bytes it waits for there


@dataclass(frozen=True)
class Join:
    """A busy group this job may join (continuous batching), if its nodes can hold the batch's
    buffer with the job's row in it (jobs/warm_groups.py `join` works that out from the row)."""

    group: GroupSpec
    plan: GroupPlan
    max_batch: int
    grow_bytes: int  # the job's own row (batch_row_bytes); joining may add more, or nothing
    held_bytes: int  # what the group held per node when offered


def plan_joins(job: Job, cluster: Cluster, settings: Settings) -> list[Join]:
    """The busy groups a generate job could join, those on its kept prefix's nodes first."""
    spec = job.record.spec
    if spec.kind != JobKind.GENERATE or spec.cache_from is not None:
        return []
    by_name, kept = {n.name: n for n in cluster.nodes}, set(job.prefix.kept_nodes)
    joins, head, cpu_limit = [], head_before(job, cluster), settings.node_max_groups
    for warm in sorted(cluster.busy, key=lambda w: not set(w.group.nodes) & kept):
        group = warm.group
        wanted = batches(group, spec.ranks, spec.strategy)
        if not wanted or not set(group.nodes) <= set(by_name):
            continue
        if head and not head.leaves_a_slot(group.nodes, cluster.nodes, cluster.held, cpu_limit):
            continue
        limit = group_batch_limit(group, settings)  # as its ranks read it
        layout = Layout(group.strategy, group.ranks, group.kv_layout)
        # the group's own chunk (what its reservation was planned with); else the smallest
        backend = by_name[group.nodes[0]].backend
        chunk = warm.chunk_tokens or chunk_candidates(backend, settings.prefill_chunk_tokens)[-1]
        plan = group_plan(job, cluster, layout, group.nodes, chunk, settings)
        if limit > 1 and runs_like(group, job, plan):
            node = capacity(by_name[group.nodes[0]], 0, job.model_dtype)
            shape = job.shape.in_dtype(node.compute_dtype_bytes or job.shape.compute_dtype_bytes)
            grow = batch_row_bytes(shape, len(job.tokens), job.new_tokens, layout)
            joins.append(Join(group, plan, limit, grow, warm.bytes_per_node))
    return joins


def batches(group: GroupSpec, ranks: int | str, strategy: str) -> bool:
    """Whether `group` decodes in batches and is the layout a job asked for."""
    batched = group.strategy == "single" or (
        group.strategy == "ring" and group.kv_layout == "replicated"
    )
    asked_size = ranks in ("auto", group.ranks)
    return batched and asked_size and strategy in ("auto", group.strategy)


def plan_admission(job: Job, cluster: Cluster, settings: Settings) -> Place | Wait:
    if not cluster.nodes:
        if cluster.known_nodes:
            return Wait(
                f"no node agent is live right now ({cluster.known_nodes} registered before): "
                "waiting for one"
            )
        raise AdmissionError("no live nodes: start one with `ringq node` (or `ringq up`)")
    if (prefilling := wait_for_pending(job.prefix, len(job.tokens))) is not None:
        return Wait(prefilling)
    request, reason = placement_request(job, cluster, settings)
    behind = behind_head(job, cluster)
    if (resumed := plan_resume(job, behind, request, settings)) is not None:
        return resumed
    if behind.idle and (warm := plan_warm(job, behind, request, settings, reason)):
        return warm
    try:
        chosen = plan_placement(job.shape, request, capacities(job, behind, settings))
    except CannotPlace as busy:
        return plan_memory_wait(job, cluster, request, settings, busy)
    plan = group_plan(job, cluster, chosen.layout, chosen.nodes, chosen.chunk_tokens, settings)
    return Place(plan, chosen.bytes_per_node, reason)


def plan_memory_wait(
    job: Job, cluster: Cluster, request: PlacementRequest, settings: Settings, busy: CannotPlace
) -> Wait:
    """A job that fits nowhere now: if it would fit once the running groups are done it waits
    for memory, naming the nodes and bytes it waits for (`hold`: held for it while it is the
    head); else Reject, or it waits for registered nodes to come back."""
    empty = capacities(job, cluster, settings, empty=True)
    try:
        waited = plan_placement(job.shape, hold_request(job, cluster, request, settings), empty)
    except CannotPlace as never:
        if (wait := wait_for_known_nodes(request, cluster, never)) is not None:
            return wait
        raise AdmissionError(str(never)) from None
    hold = dict.fromkeys(waited.nodes, waited.bytes_per_node)
    # idle groups make way only for a job that would then fit: evicting the warm group the head
    # is about to reuse costs the head a cold start
    behind = behind_head(job, cluster)
    evict = [group for group, _ in cluster.idle] if fits_now(job, behind, request, settings) else []
    reason = f"waiting for memory that running groups hold (or for a free GPU): {busy}"
    head = head_before(job, cluster)
    if head is not None and fits_now(job, cluster, request, settings):  # but for the hold
        nodes = ", ".join(sorted(head.bytes_per_node))
        reason = f"waiting behind job {head.job_id}, the oldest job waiting for memory: what "
        reason += f"it needs on {nodes} is held for it"
    return Wait(reason, evict, hold)


def fits_now(job: Job, cluster: Cluster, request: PlacementRequest, settings: Settings) -> bool:
    """Whether the job fits the cluster as read (idle warm groups counted as free)."""
    try:
        plan_placement(job.shape, request, capacities(job, cluster, settings, idle=True))
    except CannotPlace:
        return False
    return True


def hold_request(
    job: Job, cluster: Cluster, request: PlacementRequest, settings: Settings
) -> PlacementRequest:
    """The request whose placement on an empty cluster names the nodes a waiting job holds:
    those it holds already, as the head (a hold that wandered could wait for ever), else those
    with room now, then its kept prefix's."""
    head = cluster.head
    if head is not None and head.job_id == job.record.id:
        return replace(request, preferred_nodes=tuple(head.bytes_per_node))
    room = [node.name for node in capacities(job, cluster, settings) if node.available_bytes > 0]
    return replace(request, preferred_nodes=(*room, *request.preferred_nodes))


def head_before(job: Job, cluster: Cluster) -> HeadHold | None:
    """The hold a job plans around: an older job's; none for the head itself."""
    head = cluster.head
    return None if head is None or head.job_id == job.record.id else head


def behind_head(job: Job, cluster: Cluster) -> Cluster:
    """The cluster as a job behind the head sees it: the head's hold counts as a group."""
    head = head_before(job, cluster)
    return cluster if head is None else replace(cluster, held=head.held_with(cluster.held))


def join_budgets(job: Job, cluster: Cluster) -> dict[str, int]:
    """Node -> the budget a join may grow a running group's reservation to."""
    if (head := head_before(job, cluster)) is not None:
        return head.join_budgets(cluster.nodes)
    return {node.name: node.memory_bytes for node in cluster.nodes}


def plan_resume(
    job: Job, cluster: Cluster, request: PlacementRequest, settings: Settings
) -> Place | Wait | None:
    """A retry on the nodes that hold its checkpoint, in its layout and rank order (rank r must
    run where part r is); it waits while idle groups there make way. None: no checkpoint, a
    holder is not live, or running jobs fill them: the retry is then placed as any other."""
    hint = job.checkpoint
    live = {node.name: node for node in cluster.nodes}
    if hint is None or not job.record.attempt or not set(hint.nodes) <= set(live):
        return None
    reasons = job.record.retry_reasons
    if len(hint.nodes) > 1 and reasons and "stalled" in reasons[-1]:
        return None  # a stalled group may have been a cut link between these very nodes
    request = replace(
        request,
        ranks=len(hint.nodes),
        strategy=hint.strategy,
        kv_layout=hint.kv_layout,
        preferred_nodes=hint.nodes,
    )
    holders = replace(
        cluster,
        nodes=[live[name] for name in hint.nodes],
        idle=[(g, held) for g, held in cluster.idle if set(g.nodes) & set(hint.nodes)],
    )
    reason = f"a retry: continues from its checkpoint at {hint.tokens} tokens ({hint.label})"
    same = replace(holders, idle=[i for i in holders.idle if tuple(i[0].nodes) == hint.nodes])
    if same.idle and (warm := plan_warm(job, same, request, settings, reason)):
        return warm
    try:
        chosen = plan_placement(job.shape, request, capacities(job, holders, settings))
    except CannotPlace:
        try:  # idle groups hold the nodes: ask them to make way
            plan_placement(job.shape, request, capacities(job, holders, settings, idle=True))
        except CannotPlace:
            return None
        return Wait(f"{reason}: waiting for idle groups there", [g for g, _ in holders.idle])
    plan = group_plan(job, holders, chosen.layout, hint.nodes, chosen.chunk_tokens, settings)
    return Place(plan, chosen.bytes_per_node, reason)


def wait_for_known_nodes(
    request: PlacementRequest, cluster: Cluster, never: CannotPlace
) -> Wait | None:
    """A job that needs more nodes than are live now, but no more than have registered, waits
    for the missing ones: a node agent that `ringq up` is restarting is back in seconds (the
    chaos soak failed 56 of 200 two-node jobs while one was down)."""
    needed = request.ranks or (2 if request.strategy in ("ring", "pipeline") else 1)
    if len(cluster.nodes) < needed <= cluster.known_nodes:
        return Wait(f"{never}: waiting for the other registered nodes to come back")
    return None


def plan_warm(
    job: Job, cluster: Cluster, request: PlacementRequest, settings: Settings, reason: str
) -> Place | None:
    """An idle group with the plan a fresh group would get if idle groups made way."""
    try:
        chosen = plan_placement(job.shape, request, capacities(job, cluster, settings, idle=True))
    except CannotPlace:
        return None
    live, kept = {n.name for n in cluster.nodes}, set(job.prefix.kept_nodes)
    # groups on the nodes that keep the job's prefix first (one may still hold it in memory)
    for group, held in sorted(cluster.idle, key=lambda idle: not set(idle[0].nodes) & kept):
        if not set(group.nodes) <= live or len(group.nodes) != chosen.layout.size:
            continue
        plan = group_plan(job, cluster, chosen.layout, group.nodes, chosen.chunk_tokens, settings)
        if runs_like(group, job, plan):
            need = max(held, chosen.bytes_per_node)
            warm = reason + "; reusing warm group"
            return Place(plan, need, warm, group, held, chosen.bytes_per_node)
    return None


def runs_like(group: GroupSpec, job: Job, plan: GroupPlan) -> bool:
    """Whether `group` is what a fresh group for this job and plan would be (group fields
    only: a job's chunk size may differ)."""
    return (
        group.model == job.record.spec.model
        and group.strategy == plan.layout.strategy
        and group.kv_layout == plan.layout.kv_layout
        and group.exchange == plan.exchange
        and group.transport == plan.transport
        and (group.compute_dtype or plan.compute_dtype) == plan.compute_dtype
    )


def placement_request(
    job: Job, cluster: Cluster, settings: Settings
) -> tuple[PlacementRequest, str]:
    spec = job.record.spec
    prompt, kept = len(job.tokens), job.prefix.kept_tokens
    # only the tokens left to compute decide ring or not: a question on a kept document is short
    ring_min, reason = settings.ring_min_tokens + kept, "long prompt: as many nodes as fit"
    if prompt - kept < settings.ring_min_tokens:
        reason = f"prompt under {settings.ring_min_tokens} tokens to compute: fewest nodes that fit"
    if job.record.attempt:
        ring_min, reason = sys.maxsize, "a retry: fewest nodes that fit (the lost group may "
        reason += "have been a broken link)"
    elif backlog(cluster):
        ring_min = sys.maxsize
        reason = (
            f"backlog of {cluster.waiting_jobs + 1} jobs for {len(cluster.nodes)} GPUs: one job "
            "per GPU finishes it sooner than rings"
        )
    elif one_machine(cluster.nodes):
        ring_min = 0
        reason = "the nodes share one machine's cores: a ring over them uses them all"
    if spec.ranks != "auto" or spec.strategy != "auto":
        reason = "as asked"
    if kept:
        reason += f"; {kept} prompt tokens kept by {job.prefix.kept_from}"
    cached = spec.keep_cache or spec.cache_from
    request = PlacementRequest(
        prompt_tokens=prompt,
        max_new_tokens=job.new_tokens,
        chunk_tokens=settings.prefill_chunk_tokens,
        ranks=None if spec.ranks == "auto" else spec.ranks,
        strategy="single" if cached else spec.strategy,
        ring_min_tokens=ring_min,
        kv_layout=settings.kv_layout,
        preferred_nodes=job.prefix.kept_nodes,
        checkpoint_tokens=settings.checkpoint_tokens,
    )
    return request, reason


def backlog(cluster: Cluster) -> bool:
    gpus = [n for n in cluster.nodes if n.backend == "cuda"]
    return len(gpus) == len(cluster.nodes) > 1 and cluster.waiting_jobs + 1 >= len(gpus)


def capacities(
    job: Job, cluster: Cluster, settings: Settings, *, idle: bool = False, empty: bool = False
) -> list[NodeCapacity]:
    """What admission may still promise per node: its budget less what running groups hold
    (`idle`: idle warm groups count as free; `empty`: nothing runs). A node already running as
    many groups as it may has nothing to give: one per GPU; on CPU, RINGQ_NODE_MAX_GROUPS per
    machine, counted over the CPU nodes that share its cores (`machine`)."""
    idle_ids = {group.group_id for group, _ in cluster.idle} if idle else set()
    busy_by_node: dict[str, dict[str, int]] = {}
    on_machine: dict[str, set[str]] = {}  # machine -> groups running on its CPU nodes
    for node in cluster.nodes:
        held = {} if empty else cluster.held.get(node.name, {})
        busy_by_node[node.name] = {g: b for g, b in held.items() if g not in idle_ids}
        if (cores := machine(node)) is not None:
            on_machine.setdefault(cores, set()).update(busy_by_node[node.name])
    found = []
    for node in cluster.nodes:
        busy = busy_by_node[node.name]
        cores = machine(node)
        running = len(busy) if cores is None else len(on_machine[cores])
        limit = 1 if node.backend == "cuda" else settings.node_max_groups
        free = max(0, node.memory_bytes - sum(busy.values())) if running < limit else 0
        found.append(capacity(node, free, job.model_dtype))
    return found


def machine(node: NodeInfo) -> str | None:
    """The cores a CPU node computes on, named by the address its ranks listen at: CPU nodes
    at one address (`ringq up`'s local nodes, at 127.0.0.1) share one machine's cores, so a
    group beside another there only slows both. None for a GPU node (its GPU is its own)."""
    return node.address if node.backend == "cpu" else None


def one_machine(nodes: list[NodeInfo]) -> bool:
    """Several CPU nodes, all on one machine's cores."""
    machines = {machine(n) for n in nodes}
    return len(nodes) > 1 and len(machines) == 1 and None not in machines


def capacity(node: NodeInfo, free_bytes: int, model_dtype: str) -> NodeCapacity:
    cpu = node.backend == "cpu"
    dtype_bytes = None if cpu else DTYPE_BYTES.get(model_dtype)
    return NodeCapacity(node.name, free_bytes, dense_weights=cpu, compute_dtype_bytes=dtype_bytes)


def group_plan(
    job: Job,
    cluster: Cluster,
    layout: Layout,
    names: tuple[str, ...] | list[str],
    chunk_tokens: int,
    settings: Settings,
) -> GroupPlan:
    by_name = {n.name: n for n in cluster.nodes}
    facts = [node_facts(by_name[name]) for name in names]
    exchange = None if settings.exchange == "auto" else settings.exchange
    return plan_group(
        layout,
        facts,
        model_dtype=job.model_dtype,
        chunk_tokens=chunk_tokens,
        exchange=exchange,
    )


def node_facts(node: NodeInfo) -> NodeFacts:
    return NodeFacts(node.name, node.backend, node.gpu)
