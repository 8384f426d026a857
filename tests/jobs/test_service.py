"""The whole service, for real: redis-server, dispatcher and two node agents as processes,
ranks as spawned MLX processes over mx.distributed, a tiny random-weight Llama with SmolLM2's
tokenizer."""

import time

import pytest

from jobs.errors import UnknownModelError
from jobs.lifecycle import JobState
from jobs.redis_server import connect
from jobs.schemas import JobSpec
from jobs.store import JobStore
from jobs.submit import submit_job
from tests.helpers import rank_processes

JOB_TIMEOUT_S = 120
DOCUMENT = "Ring attention splits a long prompt over several machines. " * 40


@pytest.fixture
def store(cluster):
    return JobStore(connect(cluster.url))


def run_job(store, spec, job_id=None):
    record = submit_job(store.conn, spec, job_id)
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not (record := store.get(record.id)).state.is_final:
        assert time.monotonic() < deadline, f"job stuck in {record.state}: {record}"
        time.sleep(0.2)
    return record


def generate(model_dir, **fields):
    return JobSpec(
        kind="generate",
        document=DOCUMENT,
        prompt="What does it split?",
        model=str(model_dir),
        max_tokens=12,
        **fields,
    )


def test_ring_generate_job_finishes_with_stats(store, tiny_llama_dir):
    record = run_job(store, generate(tiny_llama_dir, ranks=2), job_id="ring-job")
    assert record.state == JobState.FINISHED, record.error
    assert record.placement.strategy == "ring" and sorted(record.placement.nodes) == [
        "node-0",
        "node-1",
    ]
    result = record.result
    assert result.prompt_tokens > 400  # several 128-token chunks
    assert 1 <= result.generated_tokens <= 12 and result.text is not None
    assert len(result.peak_memory_bytes) == 2 and min(result.peak_memory_bytes) > 0
    assert result.prompt_tps > 0 and result.generation_tps > 0


def test_ring_pipeline_and_single_give_the_same_greedy_text(store, tiny_llama_dir):
    ring = run_job(store, generate(tiny_llama_dir, ranks=2))
    pipeline = run_job(store, generate(tiny_llama_dir, ranks=2, strategy="pipeline"))
    single = run_job(store, generate(tiny_llama_dir, strategy="single"))
    assert single.placement.strategy == "single" and single.placement.ranks == 1
    assert pipeline.placement.strategy == "pipeline" and pipeline.placement.ranks == 2
    assert ring.result.text == pipeline.result.text == single.result.text


def test_prefill_job(store, tiny_llama_dir):
    record = run_job(store, JobSpec(kind="prefill", document=DOCUMENT, model=str(tiny_llama_dir)))
    assert record.state == JobState.FINISHED, record.error
    assert record.result.generated_tokens == 0 and record.result.text is None


def test_prompt_longer_than_the_context_fails_clearly(store, tiny_llama_dir):
    record = run_job(
        store, generate(tiny_llama_dir, ranks=2).model_copy(update={"document": "word " * 9000})
    )
    assert record.state == JobState.FAILED
    assert "exceeds" in record.error and "context of 8192 tokens" in record.error


def test_ring_larger_than_the_cluster_fails_at_once(store, tiny_llama_dir):
    record = run_job(store, generate(tiny_llama_dir, ranks=3))
    assert record.state == JobState.FAILED and "needs 3 nodes; 2 live" in record.error


def test_unknown_model_is_refused_at_submit(store):
    with pytest.raises(UnknownModelError):
        submit_job(store.conn, JobSpec(kind="prefill", document="x", model="no-such-model"))


def test_rank_failure_fails_the_job_and_leaves_no_process(store, broken_model_dir):
    record = run_job(store, generate(broken_model_dir, ranks=2))
    assert record.state == JobState.FAILED
    assert "rank" in record.error
    group_id = record.placement.group_id
    deadline = time.monotonic() + 15
    while rank_processes(group_id):
        assert time.monotonic() < deadline, rank_processes(group_id)
        time.sleep(0.2)


def test_dispatcher_and_nodes_survive_bad_jobs(cluster, store, tiny_llama_dir, broken_model_dir):
    """Its own bad jobs (whatever ran before): ranks that fail loading, a ring larger than the
    cluster, a prompt longer than the context. Every service lives on and runs a good job."""
    bad_jobs = [
        generate(broken_model_dir, ranks=2),
        generate(tiny_llama_dir, ranks=3),
        generate(tiny_llama_dir).model_copy(update={"document": "word " * 9000}),
    ]
    for spec in bad_jobs:
        failed = run_job(store, spec)
        assert failed.state == JobState.FAILED and failed.error, failed
    cluster.check_children()
    record = run_job(store, generate(tiny_llama_dir, ranks=2))
    assert record.state == JobState.FINISHED, record.error
    cluster.check_children()
