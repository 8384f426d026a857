"""The head-of-line hold in the plan step (pure; jobs/admit_plan.py states the rule): the oldest
job waiting for memory holds the nodes it waits for; later jobs fit around it (EASY backfill)."""

import pytest

from jobs.admit_plan import Cluster, Job, Place, Wait, join_budgets, plan_admission, plan_joins
from jobs.head_hold import HeadHold
from jobs.prefix_cache import PrefixHint
from jobs.schemas import GroupSpec
from jobs.settings import Settings
from tests.jobs.test_admit_plan import GIB, MODEL, busy_single_group, cpu, generate, gpu, job

SETTINGS = Settings(redis_url=None)
GPUS = [gpu("g0", 0), gpu("g1", 1), gpu("g2", 2)]


def named(planned: Job, job_id: str) -> Job:
    record = planned.record.model_copy(update={"id": job_id})
    return Job(record, planned.tokens, planned.shape, planned.model_dtype, planned.prefix)


HEAD = named(job(8192, ranks=2), "head")  # a ring of two (a retry in the chaos soak)


def later(tokens: int = 1000) -> Job:
    return named(job(tokens), "later")  # short: one node


def head_need_bytes(nodes=GPUS) -> int:
    fresh = plan_admission(HEAD, Cluster(nodes, {}, []), SETTINGS)
    assert isinstance(fresh, Place)
    return fresh.bytes_per_node


def held_for_head() -> HeadHold:
    return HeadHold("head", {"g0": head_need_bytes(), "g1": head_need_bytes()})


def test_the_head_waits_for_memory_holding_a_free_node_and_a_busy_one():
    """g0 is free, g1 and g2 run single jobs: the ring waits, holding g0 (room now) and g1."""
    busy = {"g1": {"a": GIB}, "g2": {"b": GIB}}
    wait = plan_admission(HEAD, Cluster(GPUS, busy, []), SETTINGS)
    assert isinstance(wait, Wait) and "running groups hold" in wait.reason
    assert wait.hold == held_for_head().bytes_per_node


def test_a_later_job_does_not_take_a_node_held_for_the_head():
    """Without the hold it would take g0, and g0 and g1 might never be free together."""
    busy = {"g1": {"a": GIB}, "g2": {"b": GIB}}
    cluster = Cluster(GPUS, busy, [], head=held_for_head())
    wait = plan_admission(later(), cluster, SETTINGS)
    assert isinstance(wait, Wait)
    assert "waiting behind job head, the oldest job waiting for memory" in wait.reason
    assert "g0, g1 is held for it" in wait.reason
    assert wait.hold is not None  # it waits for memory too: the next head once this one runs


def test_a_later_job_is_placed_on_a_node_the_head_does_not_wait_for():
    """g0 (held) and g2 are free: the later job takes g2, leaving g0 to the head."""
    cluster = Cluster(GPUS, {"g1": {"a": GIB}}, [], head=held_for_head())
    place = plan_admission(later(), cluster, SETTINGS)
    assert isinstance(place, Place) and place.plan.nodes == ("g2",)


def test_the_head_runs_on_its_nodes_once_they_are_free_and_later_jobs_did_not_overtake_it():
    """In turn: the head waits; a later job arrives; g1's job ends; the later job tries again,
    then the head. The later job waits both times and the head gets g0 and g1."""
    busy = {"g1": {"a": GIB}, "g2": {"b": GIB}}
    waited = plan_admission(HEAD, Cluster(GPUS, busy, []), SETTINGS)
    assert isinstance(waited, Wait) and waited.hold is not None
    hold = HeadHold("head", waited.hold)
    assert isinstance(plan_admission(later(), Cluster(GPUS, busy, [], head=hold), SETTINGS), Wait)
    freed = {"g2": {"b": GIB}}
    assert isinstance(plan_admission(later(), Cluster(GPUS, freed, [], head=hold), SETTINGS), Wait)
    place = plan_admission(HEAD, Cluster(GPUS, freed, [], head=hold), SETTINGS)
    assert isinstance(place, Place) and place.plan.nodes == ("g0", "g1")


def test_a_head_keeps_to_the_nodes_it_holds():
    """Holding g0 and g2, it keeps them (g2's job is the one it waits for: nothing else may
    start there), where a fresh head would take g0 and g1, the first busy one by name."""
    busy = {"g1": {"a": GIB}, "g2": {"b": GIB}}
    own = HeadHold("head", {"g0": head_need_bytes(), "g2": head_need_bytes()})
    wait = plan_admission(HEAD, Cluster(GPUS, busy, [], head=own), SETTINGS)
    assert isinstance(wait, Wait) and wait.hold == own.bytes_per_node
    fresh = plan_admission(HEAD, Cluster(GPUS, busy, []), SETTINGS)
    assert isinstance(fresh, Wait) and fresh.hold is not None and set(fresh.hold) == {"g0", "g1"}


@pytest.mark.parametrize("case", ["a pending prefix", "a node to come back", "no live node"])
def test_jobs_waiting_for_anything_but_memory_hold_nothing(case):
    planned, cluster = HEAD, Cluster(GPUS[:2], {"g1": {"a": GIB}}, [])
    if case == "a pending prefix":
        hint = PrefixHint(pending_job="first", pending_tokens=8000)
        planned = Job(HEAD.record, HEAD.tokens, HEAD.shape, HEAD.model_dtype, hint)
    elif case == "a node to come back":
        cluster = Cluster(GPUS[:1], {}, [], known_nodes=2)
    else:
        cluster = Cluster([], {}, [], known_nodes=2)
    wait = plan_admission(planned, cluster, SETTINGS)
    assert isinstance(wait, Wait) and wait.hold is None


def test_a_later_job_may_use_bytes_on_a_held_cpu_node_beyond_what_the_head_needs():
    """CPU nodes run two groups: c1 is full, c0 free. A later job fits c0 beside the head's need
    only on a node large enough for both; else it waits."""
    settings = Settings(redis_url=None, node_max_groups=2)
    small = plan_admission(later(), Cluster([cpu("c0", 500)], {}, []), settings)
    assert isinstance(small, Place)
    head_bytes = head_need_bytes([cpu("c0", 500), cpu("c1", 500)])
    for room_gib, fits in ((2, True), (-2, False)):
        size_gib = (head_bytes + small.bytes_per_node) / GIB + room_gib
        nodes = [cpu("c0", size_gib), cpu("c1", size_gib)]
        hold = HeadHold("head", {"c0": head_bytes, "c1": head_bytes})
        full = {"c1": {"a": nodes[1].memory_bytes}}
        decision = plan_admission(later(), Cluster(nodes, full, [], head=hold), settings)
        assert isinstance(decision, Place) == fits, (size_gib, decision)


def test_a_job_joins_a_running_group_only_where_that_leaves_the_head_its_node():
    """A busy single group on g0: held for the head, no join (it would keep g0 busy); held
    elsewhere, the join is offered, with the head's bytes off the budget of its nodes."""
    warm = busy_single_group(Cluster([GPUS[0]], {}, []))
    running = {"g0": {"busy1": warm.bytes_per_node}}
    held_g0 = Cluster(GPUS, running, [], busy=[warm], head=held_for_head())
    assert plan_joins(generate(1000), held_g0, SETTINGS) == []
    elsewhere = HeadHold("head", {"g1": head_need_bytes(), "g2": head_need_bytes()})
    cluster = Cluster(GPUS, running, [], busy=[warm], head=elsewhere)
    [join] = plan_joins(generate(1000), cluster, SETTINGS)
    assert join.group == warm.group
    budgets = join_budgets(generate(1000), cluster)
    assert budgets == {"g0": 130 * GIB, "g1": 130 * GIB - head_need_bytes(), "g2": budgets["g1"]}


def test_the_head_is_not_held_back_by_its_own_hold():
    """No deadlock: with g0 and g1 free, the head runs there."""
    cluster = Cluster(GPUS, {"g2": {"b": GIB}}, [], head=held_for_head())
    place = plan_admission(HEAD, cluster, SETTINGS)
    assert isinstance(place, Place) and place.plan.nodes == ("g0", "g1")


def test_a_later_job_leaves_the_heads_warm_group_alone():
    """One GPU, its warm group idle, 31 single jobs queued (one at a time): a job behind the
    head could not run even if the group made way (the head's hold), so it asks nothing of it;
    the head reuses the group. Before, the first later job to try evicted it and every job
    started a fresh group (32 cold starts on an H200)."""
    one_gpu = [gpu("g0", 0)]
    first = plan_admission(named(job(4096), "first"), Cluster(one_gpu, {}, []), SETTINGS)
    assert isinstance(first, Place)
    warm = GroupSpec.from_plan(
        first.plan, group_id="warm1", job_id="first", model=MODEL, addresses=["127.0.0.1:1"]
    )
    idle = [(warm, first.bytes_per_node)]
    held = {"g0": {"warm1": first.bytes_per_node}}
    hold = HeadHold("head", {"g0": first.bytes_per_node})
    wait = plan_admission(later(4096), Cluster(one_gpu, held, idle, head=hold), SETTINGS)
    assert isinstance(wait, Wait) and wait.evict == []
    head = named(job(4096), "head")
    place = plan_admission(head, Cluster(one_gpu, held, idle, head=hold), SETTINGS)
    assert isinstance(place, Place) and place.reuse == warm
