"""The node agent's sweep of checkpoints left by jobs that ended (real Redis, real files)."""

from jobs.lifecycle import JobState
from jobs.schemas import JobKind, JobSpec
from jobs.store import JobStore
from ring_worker.runtime.checkpoint_sweep import sweep_checkpoints


def checkpoint_of(home, job_id: str) -> None:
    folder = home / "checkpoints" / job_id
    folder.mkdir(parents=True)
    (folder / "ring-replicated-2-rank0-0-512.safetensors").write_bytes(b"kv")


def test_only_the_checkpoints_of_ended_or_unknown_jobs_are_swept(redis_conn, short_tmp_path):
    store = JobStore(redis_conn)
    spec = JobSpec(kind=JobKind.PREFILL, document="x", model="random:tiny-llama")
    waiting, failed = store.create("waiting", spec), store.create("failed", spec)
    assert waiting.state == JobState.QUEUED and store.fail(failed.id, "no more retries")
    for job_id in ("waiting", "failed", "expired"):
        checkpoint_of(short_tmp_path, job_id)
    assert sweep_checkpoints(store, short_tmp_path) == ["expired", "failed"]
    assert [p.name for p in (short_tmp_path / "checkpoints").iterdir()] == ["waiting"]
    assert sweep_checkpoints(store, short_tmp_path / "elsewhere") == []
