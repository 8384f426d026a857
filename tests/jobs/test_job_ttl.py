"""RINGQ_JOB_TTL_S reaches every key a job or batch leaves in Redis."""

from pathlib import Path

import pytest

from jobs import keys
from jobs.batch import submit_batch
from jobs.batch_input import Defaults, parse_batch_lines
from jobs.cancel import cancel_job
from jobs.schemas import JobKind, JobSpec
from jobs.settings import get_settings
from jobs.store import JobStore
from jobs.submit import submit_job

TTL_S = 1234


@pytest.fixture
def short_ttl(monkeypatch):
    monkeypatch.setenv("RINGQ_JOB_TTL_S", str(TTL_S))
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def assert_ttl(conn, key: str) -> None:
    ttl = conn.ttl(key)
    assert 0 < ttl <= TTL_S, f"{key}: ttl {ttl}"


def test_job_ttl_setting_reaches_records_tokens_flags_and_batches(redis_conn, short_ttl):
    spec = JobSpec(kind=JobKind.PREFILL, document="a short document", model="random:tiny-llama")
    record = submit_job(redis_conn, spec)
    assert_ttl(redis_conn, keys.job(record.id))
    JobStore(redis_conn).set_tokens(record.id, [1, 2, 3])
    assert_ttl(redis_conn, keys.job_tokens(record.id))
    cancel_job(JobStore(redis_conn), record.id)
    assert_ttl(redis_conn, keys.job_cancel(record.id))
    line = '{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": '
    line += '{"model": "random:tiny-llama", "messages": [{"role": "user", "content": "hi"}]}}'
    defaults = Defaults(None, "random:tiny-llama", 16, 1024)
    parsed = parse_batch_lines([line], Path("."), "in.jsonl", defaults)
    batch = submit_batch(redis_conn, parsed.items, "in.jsonl")
    assert_ttl(redis_conn, keys.batch(batch.id))
    assert_ttl(redis_conn, keys.job(batch.entries[0].job_id))
