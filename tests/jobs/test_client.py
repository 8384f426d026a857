"""The Python client (jobs/client.py) against a real redis-server: what a script does."""

import json
import queue
import threading
import time
from pathlib import Path

import pytest

from jobs import keys
from jobs.client import Client
from jobs.errors import InvalidJobError, JobFailedError, JobNotFinishedError, RedisUnavailableError
from jobs.lifecycle import JobState
from jobs.schemas import JobResult, Progress
from jobs.settings import get_settings

MODEL = "random:tiny-llama"
WATCH_STEP_TIMEOUT_S = 30.0


@pytest.fixture
def client(redis_conn) -> Client:
    return Client(conn=redis_conn)


def finish(client: Client, job_id: str, text: str = "An answer.") -> None:
    for state in (JobState.ADMITTED, JobState.LOADING, JobState.PREFILL):
        client.store.transition(job_id, state)
    result = JobResult(
        text=text,
        prompt_tokens=5,
        generated_tokens=3,
        prompt_tps=1.0,
        generation_tps=1.0,
        load_s=0.0,
        prefill_s=0.0,
        decode_s=0.0,
        peak_memory_bytes=[1],
    )
    client.store.transition(job_id, JobState.FINISHED, result=result)


def test_submit_text_or_a_file(client, tmp_path):
    by_text = client.submit(document="Some text.", model=MODEL, prompt="Why?", stop=["\n"], seed=3)
    assert by_text.state == JobState.QUEUED and by_text.spec.document == "Some text."
    assert (by_text.spec.stop, by_text.spec.seed) == (["\n"], 3)
    doc = tmp_path / "report.txt"
    doc.write_text("A report.")
    by_path = client.submit(doc, kind="prefill", model=MODEL, job_id="mine")
    assert by_path.id == "mine" and by_path.spec.document_name == "report.txt"
    assert client.status("mine").spec.document == "A report."
    assert [j.id for j in client.jobs()] == ["mine", by_text.id]
    with pytest.raises(InvalidJobError, match="no such file|No such file"):
        client.submit(Path(tmp_path / "missing.txt"), model=MODEL)


def test_submit_never_guesses_whether_a_str_is_a_path(client, tmp_path):
    with pytest.raises(InvalidJobError, match=r"pathlib.Path\(...\) to read a file, or document="):
        client.submit(str(tmp_path / "report.txt"), model=MODEL)  # type: ignore[arg-type]
    with pytest.raises(InvalidJobError, match="one of them"):
        client.submit(tmp_path / "report.txt", document="Text.", model=MODEL)
    assert client.jobs() == []


def test_submit_takes_ranks_and_strategy_and_still_the_old_names(client, redis_conn):
    new = client.submit(document="Some text.", model=MODEL, ranks=2, strategy="ring")
    with pytest.warns(DeprecationWarning) as warned:
        old = client.submit(document="Some text.", model=MODEL, ring_size=2, sharding="ring")
    assert sorted(str(w.message) for w in warned) == [
        "Client.submit(ring_size=...) is deprecated, use ranks=...",
        "Client.submit(sharding=...) is deprecated, use strategy=...",
    ]
    for record in (new, old):
        assert (record.spec.ranks, record.spec.strategy) == (2, "ring")
        stored = json.loads(redis_conn.hget(keys.job(record.id), "spec"))
        assert (stored["ranks"], stored["strategy"]) == (2, "ring") and "ring_size" not in stored
    with pytest.raises(ValueError, match="strategy"):
        client.submit(document="Some text.", model=MODEL, strategy="tree")  # type: ignore[arg-type]


def test_submit_checks_max_tokens_against_the_context(client):
    with pytest.raises(InvalidJobError, match="context of 16384 tokens: lower max_tokens"):
        client.submit(document="Short.", model=MODEL, max_tokens=20000)
    assert client.jobs() == []


def test_result_waits_and_says_why_there_is_none(client):
    job = client.submit(document="Some text.", model=MODEL)
    with pytest.raises(JobNotFinishedError, match="is queued, not finished yet"):
        client.result(job.id)
    started = time.monotonic()
    with pytest.raises(JobNotFinishedError):
        client.result(job.id, wait=0.3)
    assert time.monotonic() - started >= 0.3
    finish(client, job.id)
    assert client.result(job.id, wait=5).text == "An answer."


def test_cancelled_job_result_raises_with_its_record(client):
    job = client.submit(document="Some text.", model=MODEL)
    assert client.cancel(job.id).state == JobState.CANCELLED
    with pytest.raises(JobFailedError, match="cancelled before it started") as raised:
        client.result(job.id)
    assert raised.value.record.state == JobState.CANCELLED


def test_watch_yields_each_change_until_the_job_ends(client):
    job = client.submit(document="Some text.", model=MODEL)
    yielded: queue.Queue[None] = queue.Queue()  # one item per record the watch has yielded
    steps = [
        lambda: client.store.transition(job.id, JobState.ADMITTED),
        lambda: client.store.set_progress(job.id, Progress(phase=JobState.ADMITTED, total=9)),
        lambda: client.store.fail(job.id, "broken"),
    ]

    def advance() -> None:
        """Each change once the watch has yielded the one before (a starved watcher cannot
        miss one); a watch that stops yielding ends with the job failed, not a hung test."""
        for step in steps:
            try:
                yielded.get(timeout=WATCH_STEP_TIMEOUT_S)
            except queue.Empty:
                client.store.fail(job.id, "the watch yielded nothing")
                return
            step()

    mover = threading.Thread(target=advance)
    mover.start()
    seen = []
    for record in client.watch(job.id, interval_s=0.05):
        seen.append((record.state, record.progress.total))
        yielded.put(None)
    mover.join()
    assert seen == [
        (JobState.QUEUED, 0),
        (JobState.ADMITTED, 0),
        (JobState.ADMITTED, 9),
        (JobState.FAILED, 9),
    ]


def test_batches_through_the_client(client, tmp_path):
    lines = [
        '{"custom_id": "a", "document": "One.", "max_tokens": 4}',
        "{oops",
        '{"custom_id": "b", "document": "Two.", "max_tokens": 4}',
    ]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    batch = client.batch_submit(path, model=MODEL, skip_invalid=True, batch_id="b1")
    assert [e.custom_id for e in batch.entries] == ["a", "b"] and batch.skipped_lines == 1
    finish(client, "b1-1")
    client.cancel("b1-3")
    counts = client.batch_status("b1")
    assert (counts.total, counts.completed, counts.cancelled) == (2, 1, 1)
    results = client.batch_results("b1")
    assert [line["custom_id"] for line in results.outputs] == ["a"]
    assert [line["error"]["code"] for line in results.errors] == ["cancelled", "skipped"]
    assert [b.id for b in client.batches()] == ["b1"]
    assert [j.id for j in client.jobs(batch="b1", state="cancelled")] == ["b1-3"]


def test_no_redis_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("RINGQ_HOME", str(tmp_path))
    monkeypatch.delenv("RINGQ_REDIS_URL", raising=False)
    get_settings.cache_clear()
    try:
        with pytest.raises(RedisUnavailableError, match="no Redis: start ringq with `ringq up`"):
            Client()
    finally:
        monkeypatch.undo()
        get_settings.cache_clear()
