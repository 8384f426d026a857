"""Automatic prefix reuse through the service: questions on one document submitted together
prefill it once (the others wait for that prefill, then start from its kept KV, with no flag),
answer as the same jobs with RINGQ_PREFIX_CACHE=off (the session cluster), and say where their
cached tokens came from; `ringq cache list` shows the kept prefix. Batch lines that share a
document do the same, and their output lines say how many prompt tokens were cached."""

import json
from pathlib import Path

import pytest

from jobs.batch import batch_counts, batch_results, get_batch, submit_batch
from jobs.batch_input import Defaults, parse_batch_lines, require_valid
from jobs.lifecycle import JobState
from jobs.prefix_index import PrefixIndex
from jobs.redis_server import connect
from jobs.schemas import JobKind, JobRecord, JobSpec
from jobs.store import JobStore
from jobs.submit import enqueue_jobs, new_job_id
from tests.helpers import LONG_DOCUMENT, private_cluster, wait_for

QUESTIONS = ["What does ring attention split?", "Over what?", "Why would one do that?"]


def run_together(store: JobStore, specs: list[JobSpec]) -> list[JobRecord]:
    records = enqueue_jobs(store.conn, [(new_job_id(), spec) for spec in specs])

    def done() -> list[JobRecord] | None:
        now = [store.get(r.id) for r in records]
        return now if all(r.state.is_final for r in now) else None

    return wait_for(done, "the questions", timeout_s=300)


def questions(document: str, asked: list[str], model: Path, max_tokens: int) -> list[JobSpec]:
    return [
        JobSpec(
            kind=JobKind.GENERATE,
            document=document,
            prompt=q,
            model=str(model),
            max_tokens=max_tokens,
        )  # fmt: skip
        for q in asked
    ]


@pytest.fixture(scope="module")
def reuse_cluster():
    with private_cluster("pfx", {"RINGQ_PREFILL_CHUNK_TOKENS": "128"}) as running:
        yield running


@pytest.mark.slow
def test_questions_on_one_document_prefill_it_once(reuse_cluster, cluster, tiny_llama_dir):
    document = LONG_DOCUMENT[:4000]  # ~700 tokens, on a ring over the machine's two nodes
    specs = questions(document, QUESTIONS, tiny_llama_dir, max_tokens=12)
    store = JobStore(connect(reuse_cluster.url))
    reused = run_together(store, specs)
    assert all(r.state == JobState.FINISHED for r in reused), [r.error for r in reused]
    cached = [r.result.cached_tokens for r in reused]
    assert cached[0] == 0 and all(c > 500 for c in cached[1:]), cached
    # from the first job's kept KV, or (continuous batching: the others join its group, in
    # the order they were admitted) from the group's memory of another question's prompt
    for later in reused[1:]:
        source = later.result.cache_source
        assert any(f"job {r.id}" in source for r in reused if r is not later), source
    assert all(r.placement.nodes == reused[0].placement.nodes for r in reused)
    plain = run_together(JobStore(connect(cluster.url)), specs)  # RINGQ_PREFIX_CACHE=off
    assert [r.result.cached_tokens for r in plain] == [0, 0, 0]
    assert [r.result.text for r in reused] == [r.result.text for r in plain]
    [entry] = PrefixIndex(store.conn).listing()
    # kept where its group ran (a replicated ring's rank 0 writes the KV every rank holds)
    assert entry.id == reused[0].id and set(entry.nodes()) <= set(reused[0].placement.nodes)


@pytest.mark.slow
def test_a_question_after_its_documents_batch_ended_starts_from_memory(
    reuse_cluster, tiny_llama_dir
):
    """The group decodes in batches (the CPU default); as the first question's batch empties,
    the memory tier keeps its prompt's KV (ring_worker/batch_serve.last_row_memory), so a
    question asked after it has finished reads neither the file nor recomputes."""
    document = LONG_DOCUMENT[4000:8000]
    specs = questions(document, QUESTIONS[:2], tiny_llama_dir, max_tokens=8)
    store = JobStore(connect(reuse_cluster.url))
    [first] = run_together(store, specs[:1])
    [second] = run_together(store, specs[1:])
    assert first.state == second.state == JobState.FINISHED, [first.error, second.error]
    assert second.placement.group_id == first.placement.group_id  # the warm group
    assert second.result.cache_source == f"job {first.id} (memory)"
    assert second.result.cached_tokens > 500


@pytest.mark.slow
def test_batch_lines_sharing_a_document_prefill_it_once(reuse_cluster, tiny_llama_dir):
    document = "A pipeline passes activations from stage to stage. " * 70  # ~700 tokens
    model = str(tiny_llama_dir)
    lines = [
        json.dumps({"custom_id": f"q{n}", "document": document, "prompt": q, "model": model})
        for n, q in enumerate(QUESTIONS)
    ]
    defaults = Defaults(model=None, default_model=model, max_tokens=12, max_document_bytes=10**6)
    parsed = parse_batch_lines(lines, Path("."), "shared.jsonl", defaults)
    conn = connect(reuse_cluster.url)
    batch = submit_batch(conn, require_valid(parsed, skip_invalid=False), "shared.jsonl")
    wait_for(lambda: batch_counts(conn, get_batch(conn, batch.id)).is_done, "the batch", 300)
    found = batch_results(conn, batch.id)
    assert found.errors == [] and len(found.outputs) == len(QUESTIONS)
    usages = [line["response"]["body"]["usage"] for line in found.outputs]
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
    # one line prefilled the document (the first admitted); the others started from its KV
    assert sorted(cached)[0] == 0 and all(c > 500 for c in sorted(cached)[1:]), cached
    store = JobStore(conn)
    records = [store.get(entry.job_id) for entry in batch.entries]
    assert [r.result.cached_tokens for r in records] == cached
