"""Jobs waiting for a busy group's slot run in the order they were submitted, each as soon as the
group frees (jobs/memory_waits.py `wake_admissions`, jobs/dispatcher.py `wait`): one CPU node
that runs one group, one job at a time, and a retry round of 30 s (the most allowed). The second
and third job are placed by the dispatcher's wake tries, not by their own retries."""

import uuid

from rq.job import Job
from rq.registry import FinishedJobRegistry

from jobs.lifecycle import JobState
from jobs.redis_server import connect
from jobs.schemas import JobKind, JobSpec
from jobs.store import JobStore
from jobs.submit import admit_queue, enqueue_jobs
from tests.helpers import final_record, private_cluster, wait_for

ENV = {
    "RINGQ_MAX_BATCH": "1",
    "RINGQ_NODE_MAX_GROUPS": "1",
    "RINGQ_ADMIT_RETRY_S": "30",
    "RINGQ_GROUP_IDLE_S": "60",
    "RINGQ_PREFIX_CACHE": "off",
    "RINGQ_RANK_PORT_BASE": "34700",
}


def test_waiting_jobs_take_the_freed_group_at_once_and_in_submission_order(tiny_llama_dir):
    with private_cluster("wake", ENV, node_count=1) as cluster:
        store = JobStore(connect(cluster.url))
        # ids that sort against the submission order: the queue order must not be the ids'
        ids = [f"{letter}{uuid.uuid4().hex[:8]}" for letter in "zma"]
        specs = [
            JobSpec(kind=JobKind.GENERATE, document=f"Document {i}. " * 40,
                    model=str(tiny_llama_dir), max_tokens=8)
            for i in range(len(ids))
        ]  # fmt: skip
        enqueue_jobs(store.conn, list(zip(ids, specs, strict=True)))
        records = [wait_for(lambda j=job_id: final_record(store, j), job_id, 120) for job_id in ids]
        assert [r.state for r in records] == [JobState.FINISHED] * 3
        ends = [r.updated_at for r in records]
        assert ends == sorted(ends), "not run in submission order"
        placed_by = {job.args[0]: job.id for job in finished_admissions(store)}
        assert all("-wake" in placed_by[job_id] for job_id in ids[1:]), placed_by
        groups = {r.placement.group_id for r in records if r.placement is not None}
        assert len(groups) == 1  # the warm group ran each in turn


def finished_admissions(store: JobStore) -> list[Job]:
    """The dispatcher's admissions that placed a job (RQ keeps their results for 10 min)."""
    queue = admit_queue(store.conn)
    found = [Job.fetch(i, connection=store.conn, serializer=queue.serializer)
             for i in FinishedJobRegistry(queue=queue).get_job_ids()]  # fmt: skip
    return [job for job in found if str(job.return_value()).startswith("admitted")]
