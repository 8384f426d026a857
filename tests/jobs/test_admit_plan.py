"""The dispatcher's plan step, as a pure function: Place / Wait / Reject from one reading of a
job and the cluster (no Redis)."""

import time

import pytest

from admission.estimate import Layout, batch_row_bytes
from admission.vocabulary import Transport
from jobs.admit_plan import Cluster, Job, Place, Wait, plan_admission, plan_joins
from jobs.checkpoint_marks import CheckpointHint
from jobs.errors import AdmissionError
from jobs.lifecycle import JobState
from jobs.model_catalog import read_model_shape, resolve_model
from jobs.prefix_cache import PrefixHint
from jobs.schemas import GroupSpec, JobKind, JobRecord, JobSpec, NodeInfo, Progress, WarmGroup
from jobs.settings import Settings

GIB = 1024**3
MODEL = "random:llama-3.1-8b"


def job(tokens: int, **spec_fields) -> Job:
    spec = JobSpec(kind=JobKind.PREFILL, document="x", model=MODEL, **spec_fields)
    now = time.time()
    record = JobRecord(
        id="j1",
        kind=spec.kind,
        state=JobState.QUEUED,
        spec=spec,
        progress=Progress(phase=JobState.QUEUED),
        created_at=now,
        updated_at=now,
    )
    shape = read_model_shape(resolve_model(MODEL, allowed_dirs=None), dtype="float32")
    return Job(record, list(range(tokens)), shape, "bfloat16")


def gpu(name: str, index: int, memory_gib: float = 130) -> NodeInfo:
    return NodeInfo(
        name=name,
        backend="cuda",
        memory_bytes=int(memory_gib * GIB),
        available_bytes=int(memory_gib * GIB),
        address="127.0.0.1",
        device=f"cuda:{index} NVIDIA H200",
        gpu=f"hostA/{index}",
        pid=1,
        started_at=0.0,
        heartbeat_at=time.time(),
    )


def cpu(name: str, memory_gib: float = 64, address: str | None = None) -> NodeInfo:
    """A CPU node on a machine of its own (its own address), unless `address` is shared."""
    update = {"backend": "cpu", "gpu": None, "address": address or f"host-{name}"}
    return gpu(name, 0, memory_gib).model_copy(update=update)


SETTINGS = Settings(redis_url=None)
GPUS = [gpu("g0", 0), gpu("g1", 1)]


def test_a_lone_long_job_rings_over_both_gpus_with_nccl_in_bf16():
    place = plan_admission(job(131072), Cluster(GPUS, {}, []), SETTINGS)
    assert isinstance(place, Place)
    plan = place.plan
    assert (plan.layout.strategy, plan.ranks, plan.transport) == ("ring", 2, "nccl")
    assert (plan.exchange, plan.compute_dtype, plan.chunk_tokens) == (
        "allgather",
        "bfloat16",
        16384,
    )
    assert "long prompt" in place.reason


def test_a_backlog_on_gpus_runs_one_job_per_gpu():
    place = plan_admission(job(32768), Cluster(GPUS, {}, [], waiting_jobs=5), SETTINGS)
    assert isinstance(place, Place) and place.plan.layout.strategy == "single"
    assert "backlog of 6 jobs for 2 GPUs" in place.reason


def test_a_gpu_runs_one_group_at_a_time():
    busy = {"g0": {"other": 20 * GIB}}
    place = plan_admission(job(32768), Cluster(GPUS, busy, [], waiting_jobs=3), SETTINGS)
    assert isinstance(place, Place) and place.plan.nodes == ("g1",)
    both_busy = {"g0": {"a": GIB}, "g1": {"b": GIB}}
    assert isinstance(plan_admission(job(32768), Cluster(GPUS, both_busy, []), SETTINGS), Wait)


def test_cpu_nodes_run_at_most_node_max_groups():
    nodes = [cpu("c0")]
    tiny = Settings(redis_url=None, node_max_groups=2)
    two = {"c0": {"a": GIB, "b": GIB}}
    assert isinstance(plan_admission(job(100), Cluster(nodes, {"c0": {"a": GIB}}, []), tiny), Place)
    assert isinstance(plan_admission(job(100), Cluster(nodes, two, []), tiny), Wait)


def test_cpu_nodes_of_one_machine_ring_over_it_and_run_one_group_at_a_time():
    """`ringq up`'s local CPU nodes share one machine's cores: a short prompt rings over them
    too, and a job waits while a group runs there, even one on the other node."""
    local = [cpu("c0", address="127.0.0.1"), cpu("c1", address="127.0.0.1")]
    place = plan_admission(job(100), Cluster(local, {}, []), SETTINGS)
    assert isinstance(place, Place) and place.plan.nodes == ("c0", "c1")
    assert "share one machine's cores" in place.reason
    busy = {"c0": {"a": GIB}}
    assert isinstance(plan_admission(job(100), Cluster(local, busy, []), SETTINGS), Wait)
    apart = [cpu("c0"), cpu("c1")]  # two machines: a short prompt takes one, beside the other
    place = plan_admission(job(100), Cluster(apart, busy, []), SETTINGS)
    assert isinstance(place, Place) and place.plan.nodes == ("c1",)


def test_gpu_estimates_are_in_the_models_dtype():
    """The 8B model at 8K tokens fits a 60 GiB GPU in bf16; in float32 (twice the weights) it
    would not."""
    place = plan_admission(job(8192), Cluster([gpu("g0", 0, memory_gib=60)], {}, []), SETTINGS)
    assert isinstance(place, Place) and place.bytes_per_node < 60 * GIB


def test_a_job_that_never_fits_is_rejected_and_one_that_fits_later_waits():
    small = [gpu("g0", 0, memory_gib=8)]
    with pytest.raises(AdmissionError, match="does not fit"):
        plan_admission(job(8192), Cluster(small, {}, []), SETTINGS)
    held = {"g0": {"running": 100 * GIB}}
    wait = plan_admission(job(8192), Cluster([gpu("g0", 0)], held, []), SETTINGS)
    assert isinstance(wait, Wait) and "running groups" in wait.reason


def test_no_live_node_waits_when_some_were_known_and_rejects_when_none_ever_were():
    assert isinstance(plan_admission(job(10), Cluster([], {}, [], known_nodes=2), SETTINGS), Wait)
    with pytest.raises(AdmissionError, match="no live nodes"):
        plan_admission(job(10), Cluster([], {}, []), SETTINGS)


def test_a_two_node_job_waits_while_a_known_node_is_down_and_fails_if_there_never_were_two():
    one = [cpu("n0")]
    wait = plan_admission(job(10, ranks=2), Cluster(one, {}, [], known_nodes=2), SETTINGS)
    assert isinstance(wait, Wait) and "come back" in wait.reason
    with pytest.raises(AdmissionError, match="needs 2 nodes; 1 live"):
        plan_admission(job(10, ranks=2), Cluster(one, {}, [], known_nodes=1), SETTINGS)


def idle_group(nodes: list[str], transport: Transport = "nccl") -> GroupSpec:
    return GroupSpec(
        group_id="warm1",
        job_id="old",
        model=MODEL,
        addresses=["127.0.0.1:1"] * len(nodes),
        nodes=nodes,
        strategy="ring" if len(nodes) > 1 else "single",
        exchange="allgather",
        transport=transport if len(nodes) > 1 else "ring",
        compute_dtype="bfloat16",
    )


def test_an_idle_group_of_the_same_plan_is_reused_and_others_are_asked_to_make_way():
    warm = idle_group(["g0", "g1"])
    held = {"g0": {"warm1": 30 * GIB}, "g1": {"warm1": 30 * GIB}}
    place = plan_admission(job(131072), Cluster(GPUS, held, [(warm, 30 * GIB)]), SETTINGS)
    assert isinstance(place, Place) and place.reuse == warm and place.held_bytes == 30 * GIB
    # a different plan (a rotate group where NCCL is wanted) is not reused: it is evicted
    other = idle_group(["g0", "g1"], transport="ring").model_copy(update={"exchange": "rotate"})
    wait = plan_admission(job(131072), Cluster(GPUS, held, [(other, 30 * GIB)]), SETTINGS)
    assert isinstance(wait, Wait) and wait.evict == [other]


def test_an_idle_group_takes_a_job_whose_job_fields_differ():
    """Chunk tokens are a job field (admission/group_plan.py): a job planned with another chunk
    (RINGQ_PREFILL_CHUNK_TOKENS) runs on the idle group that a fresh placement made, with its
    own chunk."""
    first = plan_admission(job(131072), Cluster(GPUS, {}, []), SETTINGS)
    assert isinstance(first, Place) and first.plan.chunk_tokens == 16384
    addresses = ["127.0.0.1:1", "127.0.0.1:2"]
    warm = GroupSpec.from_plan(
        first.plan, group_id="warm1", job_id="first", model=MODEL, addresses=addresses
    )
    held_bytes = first.bytes_per_node
    held = {n: {"warm1": held_bytes} for n in ("g0", "g1")}
    smaller_chunks = Settings(redis_url=None, prefill_chunk_tokens=4096)
    cluster = Cluster(GPUS, held, [(warm, held_bytes)])
    place = plan_admission(job(100000), cluster, smaller_chunks)
    assert isinstance(place, Place) and place.reuse == warm
    assert place.plan.chunk_tokens == 4096
    assert place.held_bytes == held_bytes and place.bytes_per_node == held_bytes


def with_prefix(planned: Job, hint: PrefixHint) -> Job:
    return Job(planned.record, planned.tokens, planned.shape, planned.model_dtype, hint)


def test_a_question_on_a_kept_document_runs_on_the_node_that_keeps_it():
    """128K tokens, 131000 of them kept on g1: one node (only ~70 to compute), g1."""
    hint = PrefixHint(kept_tokens=131000, kept_nodes=("g1",), kept_from="job d (single on g1)")
    place = plan_admission(with_prefix(job(131072), hint), Cluster(GPUS, {}, []), SETTINGS)
    assert isinstance(place, Place)
    assert (place.plan.layout.strategy, list(place.plan.nodes)) == ("single", ["g1"])
    assert "131000 prompt tokens kept by job d" in place.reason


def test_a_job_waits_for_an_in_flight_prefill_of_its_prefix():
    hint = PrefixHint(pending_job="first", pending_tokens=130816)
    wait = plan_admission(with_prefix(job(131072), hint), Cluster(GPUS, {}, []), SETTINGS)
    assert isinstance(wait, Wait) and "waiting for job first" in wait.reason


@pytest.mark.parametrize("held_gib", [30, 100])
def test_a_warm_placement_records_the_jobs_own_need_beside_what_the_group_holds(held_gib):
    """The memory tier may use what the group holds beyond the job's own need
    (ring_worker/engine/memory_tier.py): a group that ran a larger job leaves room, a smaller one
    none."""
    warm = idle_group(["g0", "g1"])
    held = {n: {"warm1": held_gib * GIB} for n in ("g0", "g1")}
    place = plan_admission(job(131072), Cluster(GPUS, held, [(warm, held_gib * GIB)]), SETTINGS)
    assert isinstance(place, Place) and place.reuse == warm
    fresh = plan_admission(job(131072), Cluster(GPUS, {}, []), SETTINGS)
    assert isinstance(fresh, Place) and fresh.job_bytes_per_node is None
    own = fresh.bytes_per_node  # what a fresh group reserves for this job
    assert place.job_bytes_per_node == own
    assert place.bytes_per_node == max(own, held_gib * GIB)


def busy_single_group(cluster: Cluster, idle_s: float = 60.0) -> WarmGroup:
    """A warm group running a generate job alone on g0, as a fresh placement makes it."""
    place = plan_admission(generate(4096), cluster, SETTINGS)
    assert isinstance(place, Place) and place.plan.layout.strategy == "single"
    group = GroupSpec.from_plan(
        place.plan,
        group_id="busy1",
        job_id="first",
        model=MODEL,
        addresses=["127.0.0.1:1"],
        idle_s=idle_s,
    )
    return WarmGroup(group=group, bytes_per_node=place.bytes_per_node, chunk_tokens=4096)


def generate(tokens: int, **spec_fields) -> Job:
    plain = job(tokens, **spec_fields)
    spec = JobSpec(kind=JobKind.GENERATE, document="x", model=MODEL, max_tokens=256, **spec_fields)
    record = plain.record.model_copy(update={"spec": spec, "kind": spec.kind})
    return Job(record, plain.tokens, plain.shape, plain.model_dtype)


def test_a_generate_job_may_join_a_busy_group_of_its_layout_growing_it_by_its_kv():
    cluster = Cluster([gpu("g0", 0)], {}, [])
    warm = busy_single_group(cluster)
    cluster = Cluster([gpu("g0", 0)], {}, [], busy=[warm])
    [join] = plan_joins(generate(1000), cluster, SETTINGS)
    shape = generate(1000).shape.in_dtype(2)  # bf16 on the GPU
    assert join.group == warm.group and join.max_batch == 32  # the CUDA default
    assert join.grow_bytes == batch_row_bytes(shape, 1000, 256, Layout("single"))
    assert join.plan.chunk_tokens == 4096  # the group's own chunk
    two = Settings(redis_url=None, max_batch=2)
    assert plan_joins(generate(1000), cluster, two)[0].max_batch == 2


def test_a_group_that_ends_with_its_job_is_offered_no_joiner():
    """Its ranks run one job (jobs.settings.group_batch_limit): idle_s 0 means no batch."""
    cluster = Cluster([gpu("g0", 0)], {}, [])
    one_shot = busy_single_group(cluster, idle_s=0.0)
    cluster = Cluster([gpu("g0", 0)], {}, [], busy=[one_shot])
    assert plan_joins(generate(1000), cluster, SETTINGS) == []


@pytest.mark.parametrize(
    "case",
    ["batching off", "a prefill job", "asks for a ring", "another model", "a pipeline group"],
)
def test_what_never_joins_a_busy_group(case):
    cluster = Cluster([gpu("g0", 0)], {}, [])
    warm = busy_single_group(cluster)
    settings, candidate = SETTINGS, generate(1000)
    if case == "batching off":
        settings = Settings(redis_url=None, max_batch=1)
    elif case == "a prefill job":
        candidate = job(1000)
    elif case == "asks for a ring":
        candidate = generate(1000, strategy="ring")
    elif case == "another model":
        group = warm.group.model_copy(update={"model": "smollm2"})
        warm = warm.model_copy(update={"group": group})
    else:
        group = warm.group.model_copy(update={"strategy": "pipeline"})
        warm = warm.model_copy(update={"group": group})
    busy = Cluster([gpu("g0", 0)], {}, [], busy=[warm])
    assert plan_joins(candidate, busy, settings) == []


def retried(planned: Job, checkpoint: CheckpointHint | None, why: str = "rank 1 was killed") -> Job:
    record = planned.record.model_copy(update={"attempt": 1, "retry_reasons": [why]})
    return Job(record, planned.tokens, planned.shape, planned.model_dtype, checkpoint=checkpoint)


RING_ON_G1_G0 = CheckpointHint("ring", "replicated", ("g1", "g0"), tokens=98304)


def test_a_retry_goes_back_to_its_checkpoint_layout_and_nodes_in_rank_order():
    """Without a checkpoint a retry takes the fewest nodes (single); with one it rings again,
    rank 0 on g1 and rank 1 on g0 as the parts lie."""
    plain = plan_admission(retried(job(131072), None), Cluster(GPUS, {}, []), SETTINGS)
    assert isinstance(plain, Place) and plain.plan.layout.strategy == "single"
    place = plan_admission(retried(job(131072), RING_ON_G1_G0), Cluster(GPUS, {}, []), SETTINGS)
    assert isinstance(place, Place)
    assert (place.plan.layout.label, place.plan.nodes) == ("ring-2 (replicated KV)", ("g1", "g0"))
    assert "continues from its checkpoint at 98304 tokens (ring-2 on g1, g0)" in place.reason


def test_a_retry_whose_checkpoint_holders_are_gone_or_full_is_placed_anywhere():
    gone = [GPUS[0], gpu("g2", 2)]
    place = plan_admission(retried(job(131072), RING_ON_G1_G0), Cluster(gone, {}, []), SETTINGS)
    assert isinstance(place, Place) and place.plan.layout.strategy == "single"
    assert "checkpoint" not in place.reason
    busy = {"g1": {"other": 20 * GIB}}  # a GPU runs one group at a time
    place = plan_admission(retried(job(131072), RING_ON_G1_G0), Cluster(GPUS, busy, []), SETTINGS)
    assert isinstance(place, Place) and place.plan.nodes == ("g0",)


def test_a_retry_reuses_an_idle_group_only_where_its_checkpoint_parts_lie():
    held = {"g0": {"warm1": 30 * GIB}, "g1": {"warm1": 30 * GIB}}
    swapped = idle_group(["g0", "g1"])  # rank 0 on g0: part 0 is on g1
    cluster = Cluster(GPUS, held, [(swapped, 30 * GIB)])
    wait = plan_admission(retried(job(131072), RING_ON_G1_G0), cluster, SETTINGS)
    assert isinstance(wait, Wait) and wait.evict == [swapped]
    assert "continues from its checkpoint" in wait.reason
    same = idle_group(["g1", "g0"])
    cluster = Cluster(GPUS, held, [(same, 30 * GIB)])
    place = plan_admission(retried(job(131072), RING_ON_G1_G0), cluster, SETTINGS)
    assert isinstance(place, Place) and place.reuse == same


def test_a_retry_after_a_stalled_ring_takes_the_fewest_nodes_despite_its_checkpoint():
    """A stall may be a cut link between the checkpoint's nodes: going back would stall again."""
    stalled = retried(job(131072), RING_ON_G1_G0, "rank 0 on node g1: stalled for 300 s")
    place = plan_admission(stalled, Cluster(GPUS, {}, []), SETTINGS)
    assert isinstance(place, Place) and place.plan.layout.strategy == "single"


STALLED = "rank 0 on node g1: stalled for 300 s"
KILLED = "rank 1 was killed by signal 9"


@pytest.mark.parametrize(
    ("reasons", "resumes"),
    [
        ([STALLED, KILLED], True),  # stalled once, then lost for another reason: back there
        ([KILLED, STALLED], False),  # the latest loss was a stall: not between those nodes
        ([STALLED, STALLED, KILLED], True),
        ([KILLED, KILLED, STALLED], False),
    ],
)
def test_a_retrys_latest_failure_decides_where_it_resumes(reasons, resumes):
    planned = job(131072)
    record = planned.record.model_copy(update={"attempt": len(reasons), "retry_reasons": reasons})
    retry = Job(
        record, planned.tokens, planned.shape, planned.model_dtype, checkpoint=RING_ON_G1_G0
    )
    place = plan_admission(retry, Cluster(GPUS, {}, []), SETTINGS)
    assert isinstance(place, Place)
    if resumes:
        assert place.plan.nodes == ("g1", "g0") and "continues from its checkpoint" in place.reason
    else:
        assert place.plan.layout.strategy == "single" and "checkpoint" not in place.reason
