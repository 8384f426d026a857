"""What the prefix bridge (ring_worker/runtime/job_prefix.py) asks a rank's JobIO for: the job's
placement and the Redis where prefixes are kept, from the service's RedisJobIO (a real Redis),
and nothing from `ringq run`'s FileJobIO, whose ranks then keep no prefixes."""

import json
from pathlib import Path

import redis

from jobs.lifecycle import JobState
from jobs.schemas import JobKind, JobSpec, Placement
from jobs.store import JobStore
from ring_worker.runtime.job_io import FileJobIO, JobIO, RedisJobIO
from ring_worker.runtime.job_prefix import memory_room

SPEC = JobSpec(kind=JobKind.GENERATE, document="d", prompt="q", model="m")


def placement(bytes_per_node: int, job_bytes_per_node: int) -> Placement:
    return Placement(
        strategy="single",
        ranks=1,
        nodes=["n0"],
        group_id="g1",
        bytes_per_node=bytes_per_node,
        job_bytes_per_node=job_bytes_per_node,
        chunk_tokens=4096,
    )


def test_a_service_rank_reads_its_placement_and_keeps_prefixes_in_the_jobs_redis(
    redis_conn: redis.Redis,
) -> None:
    store = JobStore(redis_conn, 60)
    store.create("j1", SPEC)
    io: JobIO = RedisJobIO(store, "j1", "g1")
    assert io.prefix_conn() is redis_conn
    assert io.placement() is None
    assert memory_room(io) == 0  # nothing reserved yet
    store.transition("j1", JobState.ADMITTED, placement=placement(100, 60))
    assert io.placement() == placement(100, 60)
    assert io.chunk_tokens() == 4096
    assert memory_room(io) == 40


def test_a_ringq_run_rank_has_no_placement_and_no_prefix_store(tmp_path: Path) -> None:
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"id": "j1", "spec": SPEC.model_dump(mode="json"), "tokens": [1]}))
    io: JobIO = FileJobIO(job, tmp_path / "events.jsonl")
    assert io.prefix_conn() is None
    assert io.placement() is None
    assert memory_room(io) == 0


def test_entering_the_phase_a_job_is_in_already_is_no_error(redis_conn: redis.Redis) -> None:
    """redis-py sends a command again after a connection error: a transition whose reply a
    Redis restart lost arrives twice (the crash-recovery test's job failed with "loading ->
    loading is not allowed"). The second finds the job where it was going: nothing to do."""
    store = JobStore(redis_conn, 60)
    store.create("j1", SPEC)
    store.transition("j1", JobState.ADMITTED, placement=placement(100, 60))
    io = RedisJobIO(store, "j1", "g1")
    io.enter(JobState.LOADING, 10)
    io.enter(JobState.LOADING, 10)
    assert store.get("j1").state == JobState.LOADING
