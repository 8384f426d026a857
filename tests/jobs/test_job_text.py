"""A job's text stream (jobs/job_text.py) in a real Redis: what a rank appends through
RedisJobIO.text, what a reader follows, its cap and its expiry."""

import pytest

from jobs import keys
from jobs.job_text import (
    TEXT_KEEP_AFTER_END_S,
    TEXT_STREAM_MAXLEN,
    TextDelta,
    TextFollower,
    append_text,
    end_text,
    read_text,
)
from jobs.schemas import JobKind, JobSpec
from jobs.store import JobStore
from ring_worker.runtime.job_io import RedisJobIO

JOB_TTL_S = 3600


@pytest.fixture
def store(redis_conn) -> JobStore:
    return JobStore(redis_conn, job_ttl_s=JOB_TTL_S)


def new_job(store: JobStore, job_id: str = "j1") -> str:
    spec = JobSpec(kind=JobKind.GENERATE, model="random:tiny-llama", document="doc", max_tokens=8)
    store.create(job_id, spec)
    return job_id


def test_a_rank_appends_deltas_with_offsets_and_a_reader_follows(store):
    job_id = new_job(store)
    io = RedisJobIO(store, job_id, "g1")
    for delta in ["Hel", "lo, ", "wörld 💡"]:
        io.text(delta)
    deltas, after = read_text(store.conn, job_id, "0")
    assert [(d.group, d.offset, d.text) for d in deltas] == [
        ("g1", 0, "Hel"),
        ("g1", 3, "lo, "),
        ("g1", 7, "wörld 💡"),
    ]
    follower = TextFollower()
    assert "".join(follower.take(d) for d in deltas) == "Hello, wörld 💡"
    assert read_text(store.conn, job_id, after) == ([], after)  # nothing new, no wait
    io.text("!")
    more, _ = read_text(store.conn, job_id, after, block_ms=100)
    assert [d.text for d in more] == ["!"]


def test_the_stream_expires_with_the_job(store):
    job_id = new_job(store)
    store.conn.pexpire(keys.job(job_id), 50_000)  # the record has 50 s left
    RedisJobIO(store, job_id, "g1").text("some text")
    ttl_ms = store.conn.pttl(keys.job_text(job_id))
    assert 45_000 <= ttl_ms <= 50_000


def test_the_stream_is_kept_an_hour_after_its_job_ends(store):
    job_id = new_job(store)
    RedisJobIO(store, job_id, "g1").text("some text")
    end_text(store.conn, job_id)
    ttl_ms = store.conn.pttl(keys.job_text(job_id))
    assert TEXT_KEEP_AFTER_END_S * 1000 - 5000 <= ttl_ms <= TEXT_KEEP_AFTER_END_S * 1000
    store.conn.pexpire(keys.job_text(job_id), 10_000)  # sooner already: left so
    end_text(store.conn, job_id)
    assert store.conn.pttl(keys.job_text(job_id)) <= 10_000
    end_text(store.conn, "no-text")
    assert not store.conn.exists(keys.job_text("no-text")), "no stream made for a job without"


def test_the_stream_is_capped(store):
    job_id = new_job(store)
    for n in range(TEXT_STREAM_MAXLEN + 2000):
        append_text(store.conn, job_id, TextDelta(group="g1", offset=n, text="x"))
    length = store.conn.xlen(keys.job_text(job_id))
    assert TEXT_STREAM_MAXLEN <= length < TEXT_STREAM_MAXLEN + 1000  # trimmed (approximately)


def test_a_retried_attempt_repeats_nothing(store):
    job_id = new_job(store)
    first, retry = RedisJobIO(store, job_id, "g1"), RedisJobIO(store, job_id, "g2")
    first.text("The ans")
    first.text("wer is")
    retry.text("The answer")  # the retry starts again at offset 0
    retry.text(" is 42")
    deltas, _ = read_text(store.conn, job_id, "0")
    follower = TextFollower()
    pieces = [follower.take(d) for d in deltas]
    assert pieces == ["The ans", "wer is", "", " 42"]
    assert follower.rest("The answer is 42.") == "."


def test_a_trimmed_gap_is_filled_from_the_result():
    follower = TextFollower()
    assert follower.take(TextDelta(group="g", offset=0, text="abc")) == "abc"
    assert follower.take(TextDelta(group="g", offset=10, text="klm")) == ""  # 3..10 trimmed
    assert follower.gap
    assert follower.take(TextDelta(group="g", offset=13, text="nop")) == ""
    assert follower.rest("abcdefghijklmnop") == "defghijklmnop"
    assert TextFollower(sent="abX").rest("abc") is None  # sent text that is not the result's


def test_malformed_entries_are_skipped(store):
    job_id = new_job(store)
    key = keys.job_text(job_id)
    store.conn.xadd(key, {"group": "g1", "offset": "-4", "text": "bad offset"})
    store.conn.xadd(key, {"text": "no group"})
    store.conn.xadd(key, {"group": "g1", "offset": "0", "text": b"\xff\xfe"})
    store.conn.xadd(key, {"group": "g1", "offset": "0", "text": "good"})
    deltas, _ = read_text(store.conn, job_id, "0")
    assert [d.text for d in deltas] == ["good"]
