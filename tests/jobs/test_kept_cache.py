"""KV-cache reuse on the session cluster: a prefill job keeps its cache; a generate job naming it
runs on the cache's node, computes only the prompt tokens the cache does not hold, and answers
exactly as the same generate job without the cache."""

import pytest
from pydantic import ValidationError

from jobs.lifecycle import JobState
from jobs.prefix_index import PrefixIndex
from jobs.redis_server import connect
from jobs.schemas import JobKind, JobRecord, JobSpec
from jobs.store import JobStore
from jobs.submit import submit_job
from tests.helpers import final_record, wait_for

DOCUMENT = "Kept caches let many questions share one long prefill. " * 20
QUESTION = "What do kept caches let questions share?"


@pytest.fixture
def store(cluster) -> JobStore:
    return JobStore(connect(cluster.url))


def run(store: JobStore, spec: JobSpec) -> JobRecord:
    record = submit_job(store.conn, spec)
    return wait_for(lambda: final_record(store, record.id), f"job {record.id}", timeout_s=120)


def test_a_generate_job_continues_a_kept_cache_and_answers_the_same(cluster, store, tiny_llama_dir):
    model = str(tiny_llama_dir)
    kept = run(
        store, JobSpec(kind=JobKind.PREFILL, document=DOCUMENT, model=model, keep_cache=True)
    )
    assert kept.state == JobState.FINISHED, kept.error
    assert kept.placement.strategy == "single"
    entry = PrefixIndex(store.conn).get(kept.id)  # pinned in the node's bounded store
    assert entry is not None and entry.pinned and entry.nodes() == kept.placement.nodes
    question = JobSpec(
        kind=JobKind.GENERATE, document=DOCUMENT, prompt=QUESTION, model=model, max_tokens=16
    )
    reused = run(store, question.model_copy(update={"cache_from": kept.id}))
    plain = run(store, question)
    assert reused.state == plain.state == JobState.FINISHED, (reused.error, plain.error)
    assert reused.placement.nodes == kept.placement.nodes
    assert reused.result.prompt_tokens == plain.result.prompt_tokens
    # the cache holds the chat template's head and the whole document: only the question is new
    assert kept.result.prompt_tokens - 8 < reused.result.cached_tokens < kept.result.prompt_tokens
    assert plain.result.cached_tokens == 0
    assert reused.result.text == plain.result.text


def test_cache_from_a_job_without_a_cache_fails_clearly(store, tiny_llama_dir):
    model = str(tiny_llama_dir)
    plain = run(store, JobSpec(kind=JobKind.PREFILL, document=DOCUMENT, model=model))
    spec = JobSpec(kind=JobKind.GENERATE, document=DOCUMENT, model=model, cache_from=plain.id)
    failed = run(store, spec)
    assert failed.state == JobState.FAILED and "did not keep its KV cache" in failed.error
    missing = run(store, spec.model_copy(update={"cache_from": "no-such-job"}))
    assert missing.state == JobState.FAILED and "no job 'no-such-job'" in missing.error


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"kind": JobKind.GENERATE, "keep_cache": True}, "keep_cache is for prefill jobs"),
        ({"kind": JobKind.PREFILL, "cache_from": "abc"}, "cache_from is for generate jobs"),
        ({"kind": JobKind.PREFILL, "keep_cache": True, "ranks": 2}, "live on one node"),
        ({"kind": JobKind.GENERATE, "cache_from": "a", "strategy": "ring"}, "one node"),
        ({"kind": JobKind.GENERATE, "cache_from": "bad id!"}, "invalid job id"),
    ],
)
def test_cache_options_are_checked_at_submit(fields, message):
    with pytest.raises(ValidationError, match=message):
        JobSpec(document="x", **fields)
