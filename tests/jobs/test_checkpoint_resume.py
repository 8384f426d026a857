"""A ring-2 generate job whose rank is killed late in its prefill is retried and continues from
the group's last checkpoint (RINGQ_CHECKPOINT_TOKENS) instead of token 0; its answer is the
uninterrupted run's, and no checkpoint is left once it has finished. Its layout is left to the
dispatcher: a retry would take the fewest nodes (single), but the checkpoint's nodes and layout
come first (jobs/checkpoint_marks.py)."""

import os
import signal

import pytest

from jobs.checkpoint_marks import read_marks
from jobs.lifecycle import JobState
from jobs.redis_server import connect
from jobs.schemas import JobKind, JobSpec
from jobs.store import JobStore
from jobs.submit import submit_job
from ring_worker.engine.checkpoint import SUFFIX, checkpoint_bytes
from tests.helpers import LONG_DOCUMENT, final_record, private_cluster, rank_pid, wait_for

ENV = {
    "RINGQ_PREFIX_CACHE": "off",  # these prompts must be computed, not taken from a cache
    "RINGQ_PREFILL_CHUNK_TOKENS": "64",
    "RINGQ_CHECKPOINT_TOKENS": "256",
    "RINGQ_CHECKPOINT_AFTER_S": "0",  # a short prefill checkpoints too
    "RINGQ_GROUP_IDLE_S": "0",
    "RINGQ_NODE_HEARTBEAT_S": "0.5",
    "RINGQ_NODE_TTL_S": "3",
    "RINGQ_RESERVATION_LEASE_S": "5",
    "RINGQ_RANK_PORT_BASE": "32700",
    "RINGQ_RING_MIN_TOKENS": "256",  # the prompt rings over both nodes
}


@pytest.mark.slow
def test_a_retried_ring_prefill_continues_from_its_checkpoint():
    spec = JobSpec(
        kind=JobKind.GENERATE,
        document=LONG_DOCUMENT[:4000],
        prompt="Go on.",
        max_tokens=8,
        model="random:tiny-llama",
    )
    with private_cluster("ckpt", ENV) as cluster:
        store = JobStore(connect(cluster.url))
        clean = submit_job(store.conn, spec)
        expected = wait_for(lambda: final_record(store, clean.id), "the clean run", 180)
        assert expected.state == JobState.FINISHED, expected.error
        record = submit_job(store.conn, spec)
        late = wait_for(lambda: late_in_prefill(store, record.id), "80 % of the prefill", 180)
        home = cluster.settings.home
        assert late.placement is not None and late.placement.strategy == "ring"
        wait_for(lambda: checkpoint_files(home) >= 2, "a checkpoint from each rank", 60)
        wait_for(lambda: len(read_marks(store.conn, record.id)) == 2, "both ranks' marks", 30)
        os.kill(rank_pid(late.placement.group_id, 1), signal.SIGKILL)
        end = wait_for(lambda: final_record(store, record.id), "the retried job", 180)
        assert end.state == JobState.FINISHED and end.attempt == 1, end.error
        assert end.result is not None and expected.result is not None
        assert end.result.text == expected.result.text
        assert end.placement is not None and end.placement.nodes == late.placement.nodes
        assert "continues from its checkpoint" in end.placement.reason
        logs = (cluster.settings.home / "logs").glob("*-rank0.log")
        resumed = [
            line
            for log in logs
            for line in log.read_text().splitlines()
            if f"job {record.id} rank 0: resuming from the checkpoint" in line
        ]
        assert resumed, "the retry started from token 0"
        # a finished prefill drops its chain without waiting for the writer (checkpoint.py
        # end_checkpoints): the segments and marks go as soon as the writer is done
        wait_for(lambda: checkpoint_bytes(home) == 0, "the finished job's segments deleted", 30)
        wait_for(lambda: read_marks(store.conn, record.id) == {}, "its marks cleared", 30)


def checkpoint_files(home) -> int:
    """Checkpoint parts written so far (the writer thread lags the prefill a little)."""
    root = home / "checkpoints"
    return len([p for p in root.rglob(f"*{SUFFIX}") if p.is_file()]) if root.is_dir() else 0


def late_in_prefill(store: JobStore, job_id: str):
    record = store.get(job_id)
    assert not record.state.is_final, record
    progress = record.progress
    late = record.state == JobState.PREFILL and progress.processed >= 0.8 * progress.total > 0
    return record if late else None
