"""Warm groups on a real cluster: the next job of the same model and layout runs on the loaded
group (same processes, no load), gives the same answer as a fresh group, survives a cancelled
job, and the group retires after RINGQ_GROUP_IDLE_S, freeing its memory."""

from collections.abc import Iterator

import pytest

from cli.services import LocalCluster
from jobs import keys
from jobs.cancel import cancel_job
from jobs.lifecycle import JobState
from jobs.redis_server import connect
from jobs.reservations import Reservations
from jobs.schemas import JobKind, JobRecord, JobSpec
from jobs.store import JobStore
from jobs.submit import submit_job
from tests.helpers import (
    LONG_DOCUMENT,
    final_record,
    in_prefill,
    private_cluster,
    rank_processes,
    wait_for,
)

IDLE_S = 4


@pytest.fixture(scope="module")
def warm_cluster() -> Iterator[LocalCluster]:
    env = {
        "RINGQ_GROUP_IDLE_S": str(IDLE_S),
        "RINGQ_PREFILL_CHUNK_TOKENS": "64",
        "RINGQ_RANK_PORT_BASE": "35300",
    }
    with private_cluster("warm", env) as running:
        yield running


@pytest.fixture
def store(warm_cluster) -> JobStore:
    return JobStore(connect(warm_cluster.url))


def run(store: JobStore, spec: JobSpec) -> JobRecord:
    record = submit_job(store.conn, spec)
    final = wait_for(lambda: final_record(store, record.id), f"job {record.id}", timeout_s=120)
    assert final.state == JobState.FINISHED, final.error
    return final


def generate(model, document: str = "The quick brown fox. " * 60) -> JobSpec:
    return JobSpec(kind=JobKind.GENERATE, document=document, model=str(model), max_tokens=12)


def retired(store: JobStore, record: JobRecord) -> bool:
    assert record.placement is not None
    group_id = record.placement.group_id
    reservations = Reservations(store.conn, lease_s=30)
    return (
        not rank_processes(group_id)
        and not store.conn.hexists(keys.WARM_GROUPS, group_id)
        and all(reservations.reserved_bytes(n) == 0 for n in record.placement.nodes)
    )


def test_the_next_job_runs_on_the_loaded_group_and_answers_the_same(store, tiny_llama_dir):
    cold = run(store, generate(tiny_llama_dir).model_copy(update={"ranks": 2}))
    pids = sorted(rank_processes(cold.placement.group_id))
    assert len(pids) == 2 and not cold.placement.warm and cold.result.load_s > 0
    warm = run(store, generate(tiny_llama_dir).model_copy(update={"ranks": 2}))
    assert warm.placement.group_id == cold.placement.group_id and warm.placement.warm
    assert warm.result.load_s == 0 and sorted(rank_processes(cold.placement.group_id)) == pids
    assert warm.result.text == cold.result.text  # nothing of the first job's cache is left
    other = run(store, generate(tiny_llama_dir, "Another document entirely. " * 40))
    assert other.result.text != cold.result.text
    wait_for(lambda: retired(store, cold), "the idle group to retire", timeout_s=IDLE_S + 20)


def test_a_cancelled_job_leaves_the_group_warm_for_the_next(store, tiny_llama_dir):
    spec = JobSpec(kind=JobKind.PREFILL, document=LONG_DOCUMENT, model=str(tiny_llama_dir), ranks=2)
    first = run(store, spec.model_copy(update={"document": "A short one. " * 30}))
    second = submit_job(store.conn, spec)  # longer: the group's reservation grows
    running = wait_for(lambda: in_prefill(store.get(second.id)), "the warm job's prefill")
    assert running.placement.group_id == first.placement.group_id
    cancel_job(store, second.id)
    ended = wait_for(lambda: final_record(store, second.id), "the cancel")
    assert ended.state == JobState.CANCELLED, ended.error
    third = run(store, spec.model_copy(update={"document": "A short one. " * 30}))
    assert third.placement.group_id == first.placement.group_id and third.placement.warm
    assert (
        third.placement.bytes_per_node
        == running.placement.bytes_per_node
        > (first.placement.bytes_per_node)
    )


def test_a_job_of_another_layout_gets_its_own_group(store, tiny_llama_dir):
    ring = run(store, generate(tiny_llama_dir).model_copy(update={"ranks": 2}))
    single = run(store, generate(tiny_llama_dir).model_copy(update={"strategy": "single"}))
    assert single.placement.group_id != ring.placement.group_id
    assert single.placement.strategy == "single" and not single.placement.warm
    assert single.result.text == ring.result.text
