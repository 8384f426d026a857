"""Job records against a real redis-server."""

import json
from concurrent.futures import ThreadPoolExecutor
from typing import cast

import pytest
import redis

from jobs import keys
from jobs.cancel import cancel_job, cancel_many
from jobs.errors import IllegalTransitionError, InvalidJobError, JobNotFoundError
from jobs.lifecycle import JobState
from jobs.redis_server import connect
from jobs.schemas import DROPPED_DOCUMENT, JobKind, JobResult, JobSpec, Progress
from jobs.store import FINAL_TOKENS_TTL_S, JobStore

SPEC = JobSpec(kind=JobKind.PREFILL, document="hello world")


@pytest.fixture
def store(redis_conn):
    return JobStore(redis_conn)


def test_create_and_read_back(store):
    created = store.create("j1", SPEC)
    assert store.get("j1") == created
    assert created.state == JobState.QUEUED


def test_a_record_written_with_ring_size_and_sharding_still_reads(store, redis_conn):
    """Records of the version before the rename: spec.ring_size / spec.sharding and
    placement.ring_size. They read as ranks / strategy, and the next write uses the new names."""
    store.create("old", SPEC)
    old_spec = {**SPEC.model_dump(mode="json"), "ring_size": 2, "sharding": "ring"}
    del old_spec["ranks"], old_spec["strategy"]
    old_placement = {"strategy": "ring", "ring_size": 2, "nodes": ["a", "b"], "group_id": "g",
                     "bytes_per_node": 1}  # fmt: skip
    redis_conn.hset(
        keys.job("old"),
        mapping={"spec": json.dumps(old_spec), "placement": json.dumps(old_placement)},
    )
    record = store.get("old")
    assert (record.spec.ranks, record.spec.strategy, record.placement.ranks) == (2, "ring", 2)
    store.transition("old", JobState.ADMITTED, placement=record.placement)
    written = json.loads(redis_conn.hget(keys.job("old"), "placement"))
    assert written["ranks"] == 2 and "ring_size" not in written


def test_duplicate_id_is_rejected_and_the_first_job_kept(store):
    store.create("j1", SPEC)
    with pytest.raises(InvalidJobError, match="already exists"):
        store.create("j1", JobSpec(kind="prefill", document="other"))
    assert store.get("j1").spec.document == "hello world"


def test_transition_writes_fields_atomically(store):
    store.create("j1", SPEC)
    record = store.transition("j1", JobState.ADMITTED, progress=Progress(phase="admitted", total=9))
    assert record.state == JobState.ADMITTED and record.progress.total == 9


def test_a_write_retried_after_it_landed_is_done_not_refused(store):
    """redis-py turns a connection lost during EXEC into a WatchError, and the store retries.
    Where the server had applied the write, the retry (the same token) finds it and stops: a
    Redis restarted under queued jobs failed one with "admitted -> admitted is not allowed".
    Another write (another token) is refused as before."""
    created = store.create("j1", SPEC, write="c1")
    assert store.create("j1", SPEC, write="c1") == created
    with pytest.raises(InvalidJobError, match="already exists"):
        store.create("j1", SPEC)
    progress = Progress(phase="admitted", total=9)
    first = store.transition("j1", JobState.ADMITTED, write="t1", progress=progress)
    assert store.transition("j1", JobState.ADMITTED, write="t1") == first
    with pytest.raises(IllegalTransitionError, match="admitted -> admitted"):
        store.transition("j1", JobState.ADMITTED)


def test_illegal_transition_is_refused(store):
    store.create("j1", SPEC)
    with pytest.raises(IllegalTransitionError, match="queued -> decode"):
        store.transition("j1", JobState.DECODE)
    assert store.get("j1").state == JobState.QUEUED


def test_fail_only_once(store):
    store.create("j1", SPEC)
    assert store.fail("j1", "first reason")
    assert not store.fail("j1", "second reason")
    record = store.get("j1")
    assert record.state == JobState.FAILED and record.error == "first reason"


def test_missing_job(store):
    with pytest.raises(JobNotFoundError):
        store.get("nope")
    assert not store.fail("nope", "x")


def test_tokens_round_trip(store):
    store.create("j1", SPEC)
    store.set_tokens("j1", [1, 2, 3])
    assert store.get_tokens("j1") == [1, 2, 3]


@pytest.mark.parametrize("state", [JobState.FAILED, JobState.CANCELLED])
def test_end_moves_a_live_job_to_its_final_state_once(store, state):
    store.create("j1", SPEC)
    assert store.end("j1", state, "why")
    assert not store.end("j1", JobState.FAILED, "again")
    record = store.get("j1")
    assert record.state == record.progress.phase == state and record.error == "why"


def test_end_of_a_stale_group_leaves_the_job_alone(store):
    store.create("j1", SPEC)
    assert not store.end("j1", JobState.FAILED, "stale", group_id="g-old")
    assert store.get("j1").state == JobState.QUEUED


def test_end_refuses_states_that_need_a_result(store):
    store.create("j1", SPEC)
    with pytest.raises(ValueError, match="finished"):
        store.end("j1", JobState.FINISHED, "no result")


def test_a_create_refused_midway_leaves_no_partial_record(store, redis_url):
    """Redis refuses one of the create's writes (here an ACL without ZADD; in life a dead link
    or a full Redis between two round trips): no field of the record may be left behind, or
    every later read would find a corrupt job and the id could never be used again."""
    store.conn.execute_command("ACL", "SETUSER", "no-zadd", "on", ">pw", "~*", "+@all", "-zadd")
    try:
        limited = JobStore(redis.Redis.from_url(redis_url, username="no-zadd", password="pw"))
        with pytest.raises(redis.RedisError, match="zadd"):
            limited.create("j1", SPEC)
    finally:
        store.conn.execute_command("ACL", "DELUSER", "no-zadd")
    assert store.conn.hkeys(keys.job("j1")) == []
    assert store.create("j1", SPEC).spec == SPEC  # the id is still free


def test_concurrent_creates_of_one_id_make_one_job(store, redis_url):
    specs = [JobSpec(kind=JobKind.PREFILL, document=f"writer {i}") for i in range(8)]
    stores = [JobStore(connect(redis_url)) for _ in specs]
    with ThreadPoolExecutor(len(specs)) as pool:
        outcomes = list(pool.map(create_or_error, stores, specs))
    winners = [spec for spec, won in zip(specs, outcomes, strict=True) if won]
    assert len(winners) == 1 and store.get("j1").spec == winners[0]
    assert store.conn.zrange(keys.JOBS_INDEX, 0, -1) == [b"j1"]


def create_or_error(store: JobStore, spec: JobSpec) -> bool:
    try:
        store.create("j1", spec)
        return True
    except InvalidJobError:
        return False


def stored_text(conn: redis.Redis, job_id: str) -> bytes:
    """Every field of the job's hash, names and values, as one string of bytes."""
    fields = cast(dict[bytes, bytes], conn.hgetall(keys.job(job_id)))
    return b" ".join(name + b"=" + value for name, value in fields.items())


def test_a_final_job_drops_its_document_and_keeps_the_rest(store, redis_conn):
    """Finished (a result), failed and cancelled (the transition, and cancel_many's script):
    the record no longer holds the document; spec, result and its length stay."""
    document = "A document that only this record holds. " * 50
    spec = JobSpec(kind=JobKind.GENERATE, document=document, prompt="Why?", max_tokens=7)
    for job_id in ("done", "failed", "cancelled", "cancelled-many", "live"):
        store.create(job_id, spec)
        assert document.encode() in stored_text(redis_conn, job_id)
    for state in (JobState.ADMITTED, JobState.LOADING, JobState.PREFILL):
        store.transition("done", state)
    result = JobResult(
        text="Because.", prompt_tokens=9, generated_tokens=2, prompt_tps=1.0,
        generation_tps=1.0, load_s=0.0, prefill_s=0.1, decode_s=0.1, peak_memory_bytes=[1],
    )  # fmt: skip
    store.transition("done", JobState.FINISHED, result=result)
    store.fail("failed", "a reason")
    cancel_job(store, "cancelled")
    cancel_many(redis_conn, ["cancelled-many"], ttl_s=60)
    for job_id in ("done", "failed", "cancelled", "cancelled-many"):
        assert document.encode() not in stored_text(redis_conn, job_id), job_id
        record = store.get(job_id)
        assert record.state.is_final and record.document_dropped, job_id
        assert record.spec.document == DROPPED_DOCUMENT and record.spec.prompt == "Why?"
        assert (record.spec.max_tokens, record.document_chars) == (7, len(document))
    assert store.get("done").result == result
    assert store.get("live").spec.document == document and not store.get("live").document_dropped


def test_a_final_jobs_tokens_expire_unless_it_kept_its_kv(store, redis_conn):
    """A final job's prompt tokens are left to expire (FINAL_TOKENS_TTL_S), where they lived
    the store's whole TTL, except a `keep_cache` prefill's: cache_from jobs read them."""
    plain = JobSpec(kind=JobKind.PREFILL, document="d")
    kept = JobSpec(kind=JobKind.PREFILL, document="d", keep_cache=True)
    for job_id, spec in [("done", plain), ("kept", kept), ("cancelled", plain), ("many", plain)]:
        store.create(job_id, spec)
        store.transition(job_id, JobState.ADMITTED)
        store.set_tokens(job_id, [1, 2, 3])
    store.fail("done", "a reason")
    store.fail("kept", "a reason")
    cancel_job(store, "cancelled")
    cancel_many(redis_conn, ["many"], ttl_s=60)
    for job_id in ("done", "cancelled", "many"):
        assert 0 < redis_conn.ttl(keys.job_tokens(job_id)) <= FINAL_TOKENS_TTL_S, job_id
    assert redis_conn.ttl(keys.job_tokens("kept")) > FINAL_TOKENS_TTL_S
    assert store.get_tokens("kept") == [1, 2, 3]
