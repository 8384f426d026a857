"""Cancel, for real: a dispatcher and two node agents as processes, ring ranks as MLX processes.
SIGSTOP freezes a service or the ring at a chosen moment, so each cancel lands in the state under
test however fast the tiny model runs."""

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator

import pytest
from rq.job import Job
from rq.serializers import JSONSerializer

from admission.vocabulary import StrategyChoice
from cli.services import LocalCluster
from jobs import keys
from jobs.cancel import cancel_job
from jobs.lifecycle import JobState
from jobs.redis_server import connect
from jobs.reservations import Reservations
from jobs.schemas import JobKind, JobRecord, JobSpec, Placement, Progress
from jobs.store import JobStore
from jobs.submit import submit_job
from tests.helpers import (
    LONG_DOCUMENT,
    child_pid,
    final_record,
    in_prefill,
    private_cluster,
    rank_log,
    rank_processes,
    stopped,
    wait_for,
)


@pytest.fixture(scope="module")
def cancel_cluster() -> Iterator[LocalCluster]:
    env = {
        "RINGQ_PREFILL_CHUNK_TOKENS": "128",
        "RINGQ_RANK_PORT_BASE": "31200",
        "RINGQ_GROUP_IDLE_S": "0",  # groups end with their job (test_warm_groups keeps them)
        # Nodes stay placeable for 2 x 10 + 1 s after their last heartbeat: agents SIGSTOPped
        # while the dispatcher admits a job must still count as live on a loaded machine.
        "RINGQ_NODE_HEARTBEAT_S": "10",
        "RINGQ_NODE_TTL_S": "60",
    }
    with private_cluster("cancel", env) as running:
        yield running


@pytest.fixture(scope="module")
def batching_cluster() -> Iterator[LocalCluster]:
    """Warm groups that batch: a new group is offered for jobs to join while its ranks start."""
    env = {
        "RINGQ_PREFILL_CHUNK_TOKENS": "128",
        "RINGQ_RANK_PORT_BASE": "31400",
        "RINGQ_GROUP_IDLE_S": "30",
        "RINGQ_MAX_BATCH": "4",
        "RINGQ_PREFIX_CACHE": "off",
        "RINGQ_NODE_HEARTBEAT_S": "10",  # the agents are SIGSTOPped while jobs are admitted
        "RINGQ_NODE_TTL_S": "60",
        "RINGQ_RESERVATION_LEASE_S": "5",  # a group whose ranks never start is found in 5 s
    }
    with private_cluster("cancelb", env) as running:
        yield running


@pytest.fixture
def store(cancel_cluster):
    return JobStore(connect(cancel_cluster.url))


def prefill_spec(model_dir, strategy: StrategyChoice = "auto") -> JobSpec:
    return JobSpec(
        kind=JobKind.PREFILL,
        document=LONG_DOCUMENT,
        model=str(model_dir),
        ranks=2,
        strategy=strategy,
    )


def test_cancel_queued_job_never_starts(cancel_cluster, store, tiny_llama_dir):
    with stopped([child_pid(cancel_cluster, "dispatcher")]):
        record = submit_job(store.conn, prefill_spec(tiny_llama_dir))
        cancelled = cancel_job(store, record.id)
        assert cancelled.state == JobState.CANCELLED
        assert cancelled.error == "cancelled before it started"
    admit = Job.fetch(f"admit-{record.id}", connection=store.conn, serializer=JSONSerializer)
    wait_for(lambda: admit.get_status(refresh=True) == "finished", "the dispatcher's admit")
    assert admit.return_value() == "skipped (cancelled)"
    final = store.get(record.id)
    assert final.state == JobState.CANCELLED and final.placement is None


def test_cancel_admitted_job_starts_no_rank(cancel_cluster, store, tiny_llama_dir):
    agents = [child_pid(cancel_cluster, name) for name in cancel_cluster.node_names]
    with stopped(agents):  # the dispatcher places the job; no rank starts until they resume
        record = submit_job(store.conn, prefill_spec(tiny_llama_dir))
        wait_for(lambda: store.get(record.id).state != JobState.QUEUED, "admission")
        assert cancel_job(store, record.id).state == JobState.CANCELLED
    placement = store.get(record.id).placement
    assert placement is not None
    # the agents resume, find the job cancelled, start nothing and free its memory
    reservations = Reservations(store.conn, lease_s=30)
    for node in placement.nodes:
        wait_for(lambda n=node: reservations.reserved_bytes(n) == 0, f"{node}'s memory freed")
    assert rank_processes(placement.group_id) == []
    assert rank_log(cancel_cluster, placement, 0) == ""
    assert_group_ended_cleanly(store, placement)
    final = store.get(record.id)
    assert final.state == JobState.CANCELLED and final.error == "cancelled before it started"


def test_a_job_that_joined_a_starting_group_runs_there_when_its_first_job_is_cancelled(
    batching_cluster, tiny_llama_dir
):
    """The ranks of a new group that batches start and serve the jobs that joined it, though its
    first job was cancelled before they started: once, the agents skipped them and a joiner
    waited for the group's lease to run out (on a ring half started, for the 600 s loading
    timeout) before it was retried."""
    store = JobStore(connect(batching_cluster.url))
    agents = [child_pid(batching_cluster, name) for name in batching_cluster.node_names]

    model, short = str(tiny_llama_dir), "A short note about batching. " * 5
    ring = JobSpec(kind=JobKind.GENERATE, document=LONG_DOCUMENT, model=model, ranks=2)
    with stopped(agents):  # both jobs are placed; no rank starts until the agents resume
        first = submit_job(store.conn, ring)
        group = wait_for(lambda: store.get(first.id).placement, "the first job's admission")
        joiner = submit_job(store.conn, JobSpec(kind=JobKind.GENERATE, document=short, model=model))
        wait_for(lambda: store.get(joiner.id).state != JobState.QUEUED, "the joiner's admission")
        assert cancel_job(store, first.id).state == JobState.CANCELLED
    placed = store.get(joiner.id).placement
    assert placed is not None and placed.group_id == group.group_id, placed
    assert group.strategy == "ring" and group.ranks == 2
    done = wait_for(lambda: final_record(store, joiner.id), "the joiner to end")
    assert done.state == JobState.FINISHED, done.error
    assert done.attempt == 0 and done.placement.group_id == group.group_id
    assert store.get(first.id).state == JobState.CANCELLED


@pytest.mark.parametrize("strategy", ["ring", "pipeline"])
def test_cancel_running_job_stops_every_rank_at_a_chunk(
    cancel_cluster, store, tiny_llama_dir, strategy
):
    record = submit_job(store.conn, prefill_spec(tiny_llama_dir, strategy))
    record = wait_for(lambda: in_prefill(store.get(record.id)), "prefill to start")
    assert record.placement is not None
    assert record.placement.strategy == strategy
    ranks = rank_processes(record.placement.group_id)
    assert len(ranks) == 2
    with stopped(ranks):  # the ring waits mid-prefill while `ringq cancel` runs
        proc = ringq("cancel", record.id, "--json", url=cancel_cluster.url)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["state"] == JobState.PREFILL
    final = wait_for(lambda: final_record(store, record.id), "the job to end")
    assert final.state == JobState.CANCELLED, final.error
    assert final.error is not None
    done, total = map(
        int, re.findall(r"stopped after (\d+) of (\d+) prompt tokens", final.error)[0]
    )
    assert 0 < done < total
    assert final.result is None and final.progress.phase == JobState.CANCELLED
    assert_group_ended_cleanly(store, record.placement)
    for rank in range(2):
        assert "cancelled, stopped after" in rank_log(cancel_cluster, record.placement, rank)


def test_cancel_of_a_finished_or_unknown_job_is_an_error(cancel_cluster, store):
    finished = finished_record(store, "cancel-finished")
    proc = ringq("cancel", finished.id, url=cancel_cluster.url)
    assert proc.returncode == 1 and proc.stdout == ""
    assert "job cancel-finished is already finished" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not store.conn.exists(keys.job_cancel(finished.id))
    unknown = ringq("cancel", "no-such-job", "--json", url=cancel_cluster.url)
    assert unknown.returncode == 1 and "no job 'no-such-job'" in unknown.stderr


def finished_record(store: JobStore, job_id: str) -> JobRecord:
    """A job record walked through the lifecycle to `finished` (no ranks needed)."""
    store.create(job_id, JobSpec(kind=JobKind.PREFILL, document="short"))
    placement = Placement(strategy="single", ranks=1, nodes=["x"], group_id="g", bytes_per_node=1)
    store.transition(job_id, JobState.ADMITTED, placement=placement)
    for state in (JobState.LOADING, JobState.PREFILL):
        store.transition(job_id, state)
    return store.transition(job_id, JobState.FINISHED, progress=Progress(phase=JobState.FINISHED))


def assert_group_ended_cleanly(store: JobStore, placement: Placement) -> None:
    """No rank exited non-zero. A node agent reaps an exited rank in its monitor pass: it
    releases the rank's reservation, then (non-zero exits only) marks the group failed. So wait
    for every release, not for a guess at how long a pass takes on a loaded machine."""
    group_id = placement.group_id
    wait_for(lambda: not rank_processes(group_id), "the ranks to exit")

    def reaped() -> bool:
        return not any(store.conn.hexists(keys.node_reserved(n), group_id) for n in placement.nodes)

    wait_for(reaped, "the node agents to reap the ranks")
    assert not store.conn.exists(keys.group_failed(group_id))


def ringq(*args: str, url: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "RINGQ_REDIS_URL": url}
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def test_cancel_in_decode_keeps_the_text_generated_so_far(cancel_cluster, store):
    """random:tiny-llama has no EOS: it decodes until max_tokens unless cancelled."""
    spec = JobSpec(
        kind=JobKind.GENERATE,
        document="A short document.",
        model="random:tiny-llama",
        max_tokens=4000,
        strategy="single",
    )
    record = submit_job(store.conn, spec)

    def decoding() -> JobRecord | None:
        now = store.get(record.id)
        assert not now.state.is_final, f"job ended before it could be cancelled: {now}"
        started = now.state == JobState.DECODE and now.progress.total == spec.max_tokens
        return now if started and now.progress.processed >= 3 else None

    wait_for(decoding, "decode to start")
    cancel_job(store, record.id)
    final = wait_for(lambda: final_record(store, record.id), "the job to end")
    assert final.state == JobState.CANCELLED and "generated tokens" in (final.error or "")
    assert final.result is not None and final.result.text
    assert 3 <= final.result.generated_tokens < spec.max_tokens
    proc = ringq("result", record.id, "--json", url=cancel_cluster.url)
    assert proc.returncode == 1 and json.loads(proc.stdout)["text"] == final.result.text
