"""`ringq top`: the snapshot read from a real Redis, its one-frame and JSON output, and the ETA."""

import io
import json
import time
from collections.abc import Iterator

import pytest
from click.testing import CliRunner, Result
from rich.console import Console

from cli.main import cli
from cli.render import format_eta
from cli.top import follow
from jobs import keys
from jobs.lifecycle import JobState
from jobs.overview import eta_s, running_jobs, take_overview
from jobs.schemas import GroupSpec, JobKind, JobSpec, NodeInfo, Placement, Progress
from jobs.settings import get_settings
from jobs.store import JobStore
from jobs.submit import node_queue, submit_job
from jobs.warm_groups import WarmGroups

GiB = 1024**3


@pytest.fixture
def ringq(redis_url, redis_conn, monkeypatch) -> Iterator:
    """Run `ringq ARGS` in-process against the test Redis (emptied by redis_conn)."""
    monkeypatch.setenv("RINGQ_REDIS_URL", redis_url)
    get_settings.cache_clear()

    def invoke(*args: str) -> Result:
        return CliRunner().invoke(cli, list(args), env={"COLUMNS": "200"})  # no wrapped cells

    yield invoke
    monkeypatch.undo()
    get_settings.cache_clear()


def spec(text: str = "A short document.") -> JobSpec:
    return JobSpec(kind=JobKind.PREFILL, document=text, model="random:tiny-llama")


def node_info(name: str, memory_gib: float, available_gib: float) -> NodeInfo:
    now = time.time()
    return NodeInfo(
        name=name,
        backend="cpu",
        memory_bytes=int(memory_gib * GiB),
        available_bytes=int(available_gib * GiB),
        address="127.0.0.1",
        pid=1,
        started_at=now,
        heartbeat_at=now,
    )


@pytest.fixture
def busy(redis_conn):
    """Two live nodes, one job in prefill on both, one admitted, two still queued, one
    finished, and one command waiting on node-1's queue."""
    store = JobStore(redis_conn)
    store.put_node(node_info("node-0", 24, 20), ttl_s=60)
    store.put_node(node_info("node-1", 16, 8), ttl_s=60)
    ids = [submit_job(redis_conn, spec(), f"job-{i}").id for i in range(5)]
    placement = Placement(
        strategy="ring", ranks=2, nodes=["node-0", "node-1"], group_id="g1", bytes_per_node=1
    )
    store.transition(ids[0], JobState.ADMITTED, placement=placement)
    store.transition(ids[0], JobState.LOADING)
    store.transition(ids[0], JobState.PREFILL)
    progress = Progress(phase=JobState.PREFILL, processed=1000, total=3000, prompt_tps=100.0)
    store.set_progress(ids[0], progress)
    store.transition(
        ids[1], JobState.ADMITTED, placement=placement.model_copy(update={"nodes": ["node-1"]})
    )
    store.fail(ids[4], "gone")
    node_queue(redis_conn, "node-1").enqueue(
        "ring_worker.runtime.node_agent.start_rank", {"x": 1}, 0
    )
    idle = GroupSpec(
        group_id="warm1",
        job_id="job-old",
        model="smollm2",
        addresses=["127.0.0.1:1"],
        nodes=["node-0"],
        strategy="single",
    )
    WarmGroups(redis_conn).offer(idle, 2 * GiB)
    redis_conn.set(
        keys.group_idle("warm1"), "1", ex=60
    )  # what its rank 0 keeps alive while waiting
    return ids


def test_overview_counts_queues_nodes_and_running_jobs(redis_conn, busy):
    overview = take_overview(JobStore(redis_conn))
    queues = {q.name: q.queued for q in overview.queues}
    assert queues == {
        "ringq:admit": 5,
        "ringq:node:node-0:commands": 0,
        "ringq:node:node-1:commands": 1,
    }
    assert [n.name for n in overview.nodes] == ["node-0", "node-1"]
    assert [(j.id, j.state) for j in overview.running] == [
        ("job-0", JobState.PREFILL),
        ("job-1", JobState.ADMITTED),
    ]
    prefill = overview.running[0]
    assert prefill.progress.processed == 1000 and prefill.eta_s == pytest.approx(20.0)
    assert prefill.placement is not None and prefill.placement.nodes == ["node-0", "node-1"]
    [idle] = overview.idle_groups
    assert (idle.group_id, idle.nodes, idle.bytes_per_node) == ("warm1", ["node-0"], 2 * GiB)


def test_running_jobs_reads_in_chunks(redis_conn, busy):
    """Running jobs are read a chunk at a time: a chunk of 2 must find the same jobs as one."""
    assert [j.id for j in running_jobs(redis_conn, chunk_jobs=2)] == ["job-0", "job-1"]


def test_expired_job_records_are_skipped(redis_conn, busy):
    redis_conn.delete("ringq:job:job-1")  # its id stays in the index until cleaned
    assert [j.id for j in running_jobs(redis_conn)] == ["job-0"]


def test_top_json_is_one_object(ringq, busy):
    out = ringq("top", "--json")
    assert out.exit_code == 0, out.output
    payload = json.loads(out.stdout)
    assert set(payload) == {
        "taken_at",
        "queues",
        "nodes",
        "reserved_bytes",
        "running",
        "idle_groups",
        "busy_groups",
        "queued",
        "queued_total",
        "services",
    }
    assert [job["id"] for job in payload["queued"]] == ["job-2", "job-3"]  # oldest first
    assert payload["queued_total"] == 2
    assert payload["queues"][0] == {"name": "ringq:admit", "queued": 5, "started": 0}
    assert {n["name"]: n["available_bytes"] for n in payload["nodes"]} == {
        "node-0": 20 * GiB,
        "node-1": 8 * GiB,
    }
    job = payload["running"][0]
    assert job["id"] == "job-0" and job["progress"]["prompt_tps"] == 100.0
    assert job["placement"]["strategy"] == "ring" and job["eta_s"] == pytest.approx(20.0)


def test_top_once_prints_one_frame(ringq, busy):
    out = ringq("top", "--once")
    assert out.exit_code == 0, out.output
    for text in (
        "ringq:admit",
        "node-1",
        "job-0",
        "1000/3000",
        "ring-2 on node-0,node-1",
        "0:20",
        "idle warm groups: 1",
        "warm1",
        "2.00 GiB",
    ):
        assert text in out.stdout, text
    assert "job-4" not in out.stdout  # failed
    assert (
        "queued jobs: 2" in out.stdout
        and "job-2" in out.stdout
        and "not admitted yet" in out.stdout
    )


def test_top_shows_why_queued_jobs_wait_and_only_live_nodes_queues(redis_conn, busy):
    JobStore(redis_conn).set_waiting("job-3", "needs 3.0 GiB on node-0, 1.0 GiB free")
    JobStore(redis_conn).remove_node("node-1")  # stopped heartbeating: its record expired
    overview = take_overview(JobStore(redis_conn))
    assert [q.name for q in overview.queues] == ["ringq:admit", "ringq:node:node-0:commands"]
    reasons = {job.id: job.waiting_reason for job in overview.queued}
    assert reasons == {"job-2": None, "job-3": "needs 3.0 GiB on node-0, 1.0 GiB free"}


def test_top_on_an_empty_redis(ringq):
    out = ringq("top", "--json")
    assert out.exit_code == 0, out.output
    assert (
        json.loads(out.stdout)["running"] == []
        and "running jobs: 0" in ringq("top", "--once").stdout
    )


def test_follow_redraws_until_ctrl_c(redis_conn, busy) -> None:
    pauses: list[float] = []

    def pause(seconds: float) -> None:
        pauses.append(seconds)
        if len(pauses) == 2:
            raise KeyboardInterrupt
        JobStore(redis_conn).transition("job-1", JobState.LOADING)  # seen by the next frame

    out = io.StringIO()
    follow(redis_conn, 0.5, Console(file=out, force_terminal=True, width=160, height=60), pause)
    assert pauses == [0.5, 0.5]
    assert "admitted" in out.getvalue() and "loading" in out.getvalue()


@pytest.mark.parametrize(
    ("progress", "expected"),
    [
        (Progress(phase=JobState.PREFILL, processed=100, total=1100, prompt_tps=50.0), 20.0),
        (Progress(phase=JobState.PREFILL, processed=0, total=1100, prompt_tps=0.0), None),
        (Progress(phase=JobState.LOADING, processed=0, total=1100, prompt_tps=50.0), None),
        (Progress(phase=JobState.PREFILL, processed=1200, total=1100, prompt_tps=50.0), 0.0),
        (Progress(phase=JobState.DECODE, processed=10, total=110, generation_tps=20.0), 5.0),
        (Progress(phase=JobState.DECODE, processed=10, total=110, prompt_tps=20.0), None),
    ],
)
def test_eta_s(progress, expected):
    assert eta_s(progress) == expected


def test_a_prefills_own_eta_counts_down_from_its_report():
    """The rank's ETA (by the prompt's FLOPs) wins over tokens per second, less the time since."""
    reported = time.time() - 10
    progress = Progress(
        phase=JobState.PREFILL, processed=100, total=1100, prompt_tps=50.0, eta_s=30.0,
        updated_at=reported,
    )  # fmt: skip
    assert eta_s(progress) == pytest.approx(20.0, abs=0.5)
    assert eta_s(progress.model_copy(update={"eta_s": 5.0})) == 0.0


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(None, "-"), (0.0, "0:00"), (59.6, "1:00"), (65.0, "1:05"), (3725.0, "1:02:05")],
)
def test_format_eta(seconds, text):
    assert format_eta(seconds) == text


def test_top_shows_how_many_sequences_a_busy_group_decodes(ringq, redis_conn, busy):
    """A warm group running a batch (continuous batching): its jobs, and those decoding now."""
    store, warm = JobStore(redis_conn), WarmGroups(redis_conn)
    group = GroupSpec(
        group_id="g1",
        job_id="job-0",
        model="smollm2",
        addresses=["127.0.0.1:1", "127.0.0.1:2"],
        nodes=["node-0", "node-1"],
    )
    warm.offer(group, GiB)
    warm.started(group, "job-0")
    assert warm.join(group, "job-1", max_batch=4) == "joined"
    store.transition(busy[0], JobState.DECODE)
    [batch] = take_overview(JobStore(redis_conn)).busy_groups
    assert (batch.group_id, batch.jobs, batch.decoding) == ("g1", ["job-0", "job-1"], 1)
    out = ringq("top", "--once")
    assert out.exit_code == 0, out.output
    assert "busy warm groups: 1" in out.output and "job-0, job-1" in out.output
