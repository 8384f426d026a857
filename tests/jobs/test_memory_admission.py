"""Admission against node memory budgets, with a real dispatcher and node agents: a job that fits
once memory frees waits (saying why) and then runs; one that can never fit fails at once; and
reservations are released when groups end."""

import pytest

from jobs.lifecycle import JobState
from jobs.redis_server import connect
from jobs.reservations import Reservations
from jobs.schemas import JobKind, JobSpec
from jobs.store import JobStore
from jobs.submit import submit_job
from tests.helpers import (
    LONG_DOCUMENT,
    final_record,
    in_prefill,
    private_cluster,
    rank_processes,
    stopped,
    wait_for,
)

# The tiny model's estimate is ~0.26 GiB per rank (mostly process overhead): one group per node.
NODE_BUDGET_GIB = "0.4"


@pytest.fixture(scope="module")
def small_cluster():
    env = {
        "RINGQ_NODE_MEMORY_LIMIT_GIB": NODE_BUDGET_GIB,
        "RINGQ_PREFILL_CHUNK_TOKENS": "64",
        "RINGQ_RANK_PORT_BASE": "32200",
        "RINGQ_GROUP_IDLE_S": "2",  # the groups retire soon after, freeing their memory
        "RINGQ_PREFIX_CACHE": "off",  # same documents: the second must wait for memory, not reuse
    }
    with private_cluster("budget", env) as running:
        yield running


@pytest.fixture
def store(small_cluster):
    return JobStore(connect(small_cluster.url))


def prefill(model_dir, **fields) -> JobSpec:
    return JobSpec(kind=JobKind.PREFILL, document=LONG_DOCUMENT, model=str(model_dir), **fields)


def test_a_job_waits_for_memory_then_runs(small_cluster, store, tiny_llama_dir):
    first = submit_job(store.conn, prefill(tiny_llama_dir))  # long prompt: a ring over both nodes
    running = wait_for(lambda: in_prefill(store.get(first.id)), "the first job's prefill")
    reservations = Reservations(store.conn, lease_s=30)
    assert all(reservations.reserved_bytes(n) > 0 for n in small_cluster.node_names)
    with stopped(rank_processes(running.placement.group_id)):
        second = submit_job(store.conn, prefill(tiny_llama_dir))
        waiting = wait_for(lambda: store.get(second.id).waiting_reason, "the second job to wait")
        assert waiting.startswith(
            "waiting for memory that running groups hold (or for a free GPU): job of"
        )
        assert store.get(second.id).state == JobState.QUEUED
    for job in (first, second):
        final = wait_for(lambda j=job: final_record(store, j.id), f"job {job.id} to end")
        assert final.state == JobState.FINISHED, final.error
    assert store.get(second.id).waiting_reason is None
    wait_for(
        lambda: all(reservations.reserved_bytes(n) == 0 for n in small_cluster.node_names),
        "the reservations to be released",
    )


def test_a_job_that_can_never_fit_fails_at_once(store):
    record = submit_job(store.conn, JobSpec(kind=JobKind.PREFILL, document="short text"))
    final = wait_for(lambda: final_record(store, record.id), "the job to end")
    assert final.state == JobState.FAILED  # SmolLM2 needs ~1 GiB; each node may use 0.4
    assert "does not fit on the live nodes" in final.error and "has 0.40 GiB" in final.error


def test_a_node_under_a_budget_reports_the_os_free_memory_apart(small_cluster, store):
    """A node limited to a budget below what the OS has free plans with the budget
    (`available_bytes`) and still reports the OS's free memory (`free_bytes`, the dashboard's
    "free (OS)"), which is larger here."""
    budget = int(float(NODE_BUDGET_GIB) * 1024**3)
    for node in store.live_nodes():
        assert node.memory_bytes == budget and node.available_bytes <= budget
        assert node.free_bytes is not None and node.free_bytes > budget
