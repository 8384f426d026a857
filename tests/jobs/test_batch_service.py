"""Continuous batching through the service (issue 14): generate jobs submitted together decode in
one warm group's batch (RINGQ_MAX_BATCH=4) and answer exactly as the same jobs do one at a time
(RINGQ_MAX_BATCH=1, computed here); a cancel removes only its own sequence; a ring-2 group with
replicated KV batches too; a rank killed mid-batch retries every job of the batch once."""

import os
import re
import signal
from collections.abc import Iterator
from functools import partial

import pytest

from cli.services import LocalCluster
from jobs.cancel import cancel_job
from jobs.lifecycle import JobState
from jobs.redis_server import connect
from jobs.schemas import JobKind, JobRecord, JobSpec
from jobs.store import JobStore
from jobs.submit import enqueue_jobs, new_job_id
from jobs.warm_groups import WarmGroups
from tests.helpers import completions_of_finished, final_record, private_cluster, rank_pid, wait_for

ENV = {
    "RINGQ_PREFIX_CACHE": "off",  # every prompt computed: the reference and the batch alike
    "RINGQ_PREFILL_CHUNK_TOKENS": "64",
    "RINGQ_GROUP_IDLE_S": "30",
    "RINGQ_NODE_HEARTBEAT_S": "0.5",
    "RINGQ_NODE_TTL_S": "3",
    "RINGQ_RESERVATION_LEASE_S": "5",
}
PORT_BASE = int(os.environ.get("RINGQ_RANK_PORT_BASE", "33500"))
JOB_TIMEOUT_S = 300
DOCUMENTS = [  # different lengths: rows of different lengths (a mask) in the batch
    "The quick brown fox jumps over the lazy dog. " * 12,
    "Ring attention splits a long prompt over several machines. " * 20,
    "A short note about batching. " * 5,
    "Continuous batching lets sequences join and leave a decode batch. " * 16,
]


def cluster_with(prefix: str, env: dict[str, str], nodes: int, port: int):
    return private_cluster(
        prefix, {**ENV, **env, "RINGQ_RANK_PORT_BASE": str(port)}, node_count=nodes
    )


@pytest.fixture(scope="module")
def batching() -> Iterator[LocalCluster]:
    with cluster_with("bsvc", {"RINGQ_MAX_BATCH": "4"}, 1, PORT_BASE) as running:
        yield running


@pytest.fixture(scope="module")
def one_at_a_time(tiny_llama_dir) -> dict[str, str | None]:
    """The reference: each document's greedy text with RINGQ_MAX_BATCH=1 (one job per group
    step: the engine's own single-sequence decode)."""
    with cluster_with("bref", {"RINGQ_MAX_BATCH": "1"}, 1, PORT_BASE + 100) as reference:
        store = JobStore(connect(reference.url))
        records = run_together(store, [generate(tiny_llama_dir, d) for d in DOCUMENTS])
        groups = {r.placement.group_id for r in records if r.placement}
        for group_id in groups:  # one at a time: each job leaves its group's list too
            wait_for(partial(batch_empty, store, group_id), "an empty batch")
        results = [r.result for r in records if r.result is not None]
        assert len(results) == len(records) and all(r.batch_size == 1 for r in results)
        # records in DOCUMENTS' order; a finished job's record no longer holds its document
        return {d: result.text for d, result in zip(DOCUMENTS, results, strict=True)}


def generate(model, document: str, max_tokens: int = 24, **fields) -> JobSpec:
    return JobSpec(
        kind=JobKind.GENERATE,
        document=document,
        model=str(model),
        max_tokens=max_tokens,
        **fields,
    )


def run_together(store: JobStore, specs: list[JobSpec]) -> list[JobRecord]:
    records = enqueue_jobs(store.conn, [(new_job_id(), spec) for spec in specs])
    return [finished(store, r.id) for r in records]


def finished(store: JobStore, job_id: str) -> JobRecord:
    final = wait_for(lambda: final_record(store, job_id), f"job {job_id}", JOB_TIMEOUT_S)
    assert final.state == JobState.FINISHED, final.error
    return final


def batch_empty(store: JobStore, group_id: str) -> bool:
    """Every job left the group's batch (rank 0 says so just after each job's result)."""
    return WarmGroups(store.conn).batch(group_id) == []


def decoding(store: JobStore, job_ids: list[str]) -> bool:
    records = [store.get(j) for j in job_ids]
    assert not any(r.state.is_final for r in records), [r.error for r in records]
    return all(r.state == JobState.DECODE and r.progress.processed > 1 for r in records)


def test_jobs_submitted_together_decode_in_one_batch_and_answer_as_alone(
    batching, one_at_a_time, tiny_llama_dir
):
    store = JobStore(connect(batching.url))
    records = run_together(store, [generate(tiny_llama_dir, d) for d in DOCUMENTS])
    assert [r.result.text for r in records] == [one_at_a_time[d] for d in DOCUMENTS]
    assert len({r.placement.group_id for r in records}) == 1  # one group took them all
    assert max(r.result.batch_size for r in records) > 1
    assert all(r.result.batch_size <= 4 for r in records)
    wait_for(partial(batch_empty, store, records[0].placement.group_id), "an empty batch")
    assert all("joined the decode batch" in r.placement.reason for r in records[1:])


def test_a_cancelled_job_leaves_the_batch_and_the_others_finish(batching, tiny_llama_dir):
    store = JobStore(connect(batching.url))
    specs = [generate(tiny_llama_dir, d, max_tokens=1500) for d in DOCUMENTS[:3]]
    jobs = enqueue_jobs(store.conn, [(new_job_id(), spec) for spec in specs])
    ids = [j.id for j in jobs]
    wait_for(lambda: decoding(store, ids), "three jobs decoding together", JOB_TIMEOUT_S)
    cancel_job(store, ids[1])
    victim = wait_for(lambda: final_record(store, ids[1]), "the cancel", JOB_TIMEOUT_S)
    assert victim.state == JobState.CANCELLED
    assert victim.result is not None and 0 < victim.result.generated_tokens < 1500
    for job_id in (ids[0], ids[2]):
        record = finished(store, job_id)
        assert record.result.batch_size == 3
        assert record.placement.group_id == victim.placement.group_id


def test_a_rank_killed_mid_batch_retries_every_job_of_the_batch_once(batching, tiny_llama_dir):
    store = JobStore(connect(batching.url))
    specs = [generate(tiny_llama_dir, d, max_tokens=1500) for d in DOCUMENTS[:3]]
    ids = [j.id for j in enqueue_jobs(store.conn, [(new_job_id(), s) for s in specs])]
    wait_for(lambda: decoding(store, ids), "three jobs decoding together", JOB_TIMEOUT_S)
    group_id = store.get(ids[0]).placement.group_id
    os.kill(rank_pid(group_id, 0), signal.SIGKILL)
    for job_id in ids:
        record = finished(store, job_id)
        assert record.attempt == 1 and record.placement.group_id != group_id
        assert "rank 0 on node bsvc-0 was killed by signal 9" in record.retry_reasons[0]
        assert completions_of_finished(batching, job_id) == 1


def test_a_second_burst_batches_in_the_same_warm_group_and_answers_as_alone(
    one_at_a_time, tiny_llama_dir
):
    """Once a batch has emptied, the next burst runs in the same warm group, batched again,
    and every job still answers exactly as alone; the group logs where each batch's time went."""
    env = {"RINGQ_MAX_BATCH": "4"}
    with cluster_with("bagain", env, 1, PORT_BASE + 300) as batching:
        store = JobStore(connect(batching.url))
        records = run_together(store, [generate(tiny_llama_dir, d) for d in DOCUMENTS])
        wait_for(partial(batch_empty, store, records[0].placement.group_id), "an empty batch")
        again = run_together(store, [generate(tiny_llama_dir, d) for d in DOCUMENTS])
        logs = "".join(p.read_text() for p in (batching.settings.home / "logs").glob("*rank0.log"))
    for burst in (records, again):
        assert [r.result.text for r in burst] == [one_at_a_time[d] for d in DOCUMENTS]
    assert len({r.placement.group_id for r in records + again}) == 1
    assert max(r.result.batch_size for r in again) > 1
    assert len(re.findall(r"hand-off \d+\.\d\ds, results \d+\.\d\ds;", logs)) >= 2


def test_a_ring_of_two_with_replicated_kv_batches_too(one_at_a_time, tiny_llama_dir):
    env = {"RINGQ_MAX_BATCH": "4", "RINGQ_KV_LAYOUT": "replicated"}
    with cluster_with("bring", env, 2, PORT_BASE + 200) as ring:
        store = JobStore(connect(ring.url))
        asked = {"ranks": 2, "strategy": "ring"}
        records = run_together(store, [generate(tiny_llama_dir, d, **asked) for d in DOCUMENTS])
    assert all(r.placement.strategy == "ring" and r.placement.ranks == 2 for r in records)
    assert len({r.placement.group_id for r in records}) == 1
    assert max(r.result.batch_size for r in records) > 1
    assert [r.result.text for r in records] == [one_at_a_time[d] for d in DOCUMENTS]
