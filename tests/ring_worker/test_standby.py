"""A node agent's spare rank (RINGQ_STANDBY_RANK): started ahead, it becomes the next group's
rank, and the agent starts another. On by default on GPU nodes; turned on here on CPU."""

import pytest

from jobs.lifecycle import JobState
from jobs.redis_server import connect
from jobs.schemas import JobKind, JobSpec
from jobs.store import JobStore
from jobs.submit import submit_job
from tests.helpers import final_record, private_cluster, rank_log, wait_for


@pytest.mark.slow
def test_new_groups_start_on_spare_ranks(tiny_llama_dir):
    env = {"RINGQ_STANDBY_RANK": "on", "RINGQ_GROUP_IDLE_S": "0"}  # every job: a new group
    with private_cluster("standby", env) as cluster:
        conn = connect(cluster.url)
        store = JobStore(conn)
        spec = JobSpec(
            kind=JobKind.GENERATE,
            document="A spare rank takes the job. " * 20,
            model=str(tiny_llama_dir),
            max_tokens=4,
            ranks=1,
        )
        ids = [submit_job(conn, spec).id for _ in range(2)]
        for job_id in ids:
            record = wait_for(lambda job_id=job_id: final_record(store, job_id), f"job {job_id}")
            assert record.state == JobState.FINISHED, record.error
            assert record.placement is not None
            text = wait_for(
                lambda r=record: done_log(cluster, r), f"job {job_id}'s rank to log done"
            )
            assert "a spare rank took it" in text


def done_log(cluster, record) -> str:
    """Rank 0's log once it says "done" (it does after the result and after keeping the
    prompt's KV), else ""."""
    text = rank_log(cluster, record.placement, 0)
    return text if "rank 0: done" in text else ""
