"""Batches created through `ringq serve` are fed in a window (jobs/batch_feed.py), against a
real redis-server and real uvicorn apps with their feeder threads. No cluster: the test ends jobs
itself, as a node does (the store's transitions, with a result) or as a user does (a cancel over
HTTP); tests/cli/test_http_openai.py runs a windowed batch on a real cluster."""

import json
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import openai
import pytest
import redis

from jobs import keys
from jobs.batch import batch_counts, get_batch, submit_batch
from jobs.batch_feed import BatchFeeder, spool_path
from jobs.batch_input import Defaults, parse_batch_lines
from jobs.lifecycle import JobState
from jobs.schemas import JobResult
from jobs.settings import Settings
from jobs.store import JobStore
from jobs.submit import admit_queue
from tests.cli.http_serving import call, serving
from tests.helpers import wait_for

MODEL = "random:tiny-llama"
LONG_MODEL = "random:llama-3.1-8b"  # a 128K context holds a 100 KB document (no job runs here)
WINDOW = 4
DOCUMENT_BYTES = 100 * 1024


def line(custom_id: str, content: str = "Hi", model: str = MODEL) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(one) + "\n" for one in lines).encode()


@pytest.fixture
def settings(redis_url, redis_conn, tmp_path) -> Settings:
    return Settings(home=tmp_path, redis_url=redis_url, batch_window=WINDOW)


@contextmanager
def served(settings: Settings) -> Iterator[tuple[openai.OpenAI, str]]:
    assert settings.redis_url is not None
    with serving(settings, settings.redis_url) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0), url


def create_batch(client: openai.OpenAI, lines: list[dict]) -> str:
    uploaded = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    return start_batch(client, uploaded.id)


def start_batch(client: openai.OpenAI, file_id: str) -> str:
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    wait_for(lambda: client.batches.retrieve(batch.id).status != "validating", "validation", 120)
    assert client.batches.retrieve(batch.id).status == "in_progress"
    return batch.id


def wait_status(client: openai.OpenAI, batch_id: str, status: str):
    wait_for(lambda: client.batches.retrieve(batch_id).status == status, status, 60)
    return client.batches.retrieve(batch_id)


def job_states(conn: redis.Redis, batch_id: str) -> dict[str, JobState]:
    """The batch's jobs that exist in Redis, by id, with their states."""
    ids = [entry.job_id for entry in get_batch(conn, batch_id).entries]
    raw = [conn.hget(keys.job(job_id), "state") for job_id in ids]
    return {i: JobState(json.loads(r)) for i, r in zip(ids, raw, strict=True) if r is not None}


def wait_jobs(conn: redis.Redis, batch_id: str, count: int) -> None:
    """Until `count` of the batch's jobs exist: the feeder has filled the window."""
    wait_for(lambda: len(job_states(conn, batch_id)) == count, f"{count} jobs of the batch")


def unfinished(states: dict[str, JobState]) -> list[str]:
    return [job_id for job_id, state in states.items() if not state.is_final]


def finish(store: JobStore, job_id: str) -> None:
    """What a node's lead rank writes as a job runs and finishes."""
    for state in (JobState.ADMITTED, JobState.LOADING, JobState.PREFILL):
        store.transition(job_id, state)
    result = JobResult(
        text=f"answer of {job_id}", prompt_tokens=3, generated_tokens=2, prompt_tps=1.0,
        generation_tps=1.0, load_s=0.0, prefill_s=0.1, decode_s=0.1, peak_memory_bytes=[1],
    )  # fmt: skip
    store.transition(job_id, JobState.FINISHED, result=result)


def file_lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    assert file_id is not None
    return [json.loads(text) for text in client.files.content(file_id).text.splitlines()]


def test_a_batch_keeps_its_window_in_redis_and_every_line_ends_in_order(settings, redis_conn):
    """10 lines, a window of 4: at every step at most 4 of its jobs are unfinished, the feeder
    enqueues the next as one ends, and the files hold every line in input order; no final
    record holds its document."""
    count, store = 10, JobStore(redis_conn)
    lines = [line(f"req-{i}", f"Question number {i} about rings?") for i in range(count)]
    with served(settings) as (client, url):
        batch_id = create_batch(client, lines)
        counts = batch_counts(redis_conn, get_batch(redis_conn, batch_id))  # ringq batch status
        assert (counts.total, counts.queued) == (count, count)
        assert client.batches.retrieve(batch_id).request_counts.total == count
        for ended in range(count):
            wait_jobs(redis_conn, batch_id, min(count, ended + WINDOW))
            states = job_states(redis_conn, batch_id)
            assert len(unfinished(states)) <= WINDOW, states
            oldest = unfinished(states)[0]
            if ended % 2 == 0:
                finish(store, oldest)
            else:
                status, _, _ = call("POST", f"{url}/api/jobs/{oldest}/cancel")
                assert status == 200
        done = wait_status(client, batch_id, "completed")
        assert done.request_counts.model_dump() == {"total": 10, "completed": 5, "failed": 5}
        outputs = file_lines(client, done.output_file_id)
        errors = file_lines(client, done.error_file_id)
        assert [one["custom_id"] for one in outputs] == [f"req-{i}" for i in range(0, count, 2)]
        assert [one["custom_id"] for one in errors] == [f"req-{i}" for i in range(1, count, 2)]
        assert {one["error"]["code"] for one in errors} == {"cancelled"}
        assert outputs[0]["response"]["body"]["choices"][0]["message"]["content"] == (
            f"answer of {batch_id}-1"
        )
        assert not spool_path(settings, batch_id).exists()
    for job_id, question in zip(job_states(redis_conn, batch_id), lines, strict=True):
        stored = b"".join(redis_conn.hgetall(keys.job(job_id)).values())
        assert question["body"]["messages"][0]["content"].encode() not in stored
        assert store.get(job_id).document_dropped


def test_redis_memory_stays_flat_under_a_batch_of_large_documents(settings, redis_conn):
    """200 lines of 100 KB: creating the batch through `ringq serve` raises Redis's used_memory
    by at most the window's documents and 2 MiB; enqueued whole, as `ringq batch submit` does,
    the same lines raise it by their 20 MB."""
    count, margin = 200, 2 * 1024 * 1024
    text = ("ring attention " * (DOCUMENT_BYTES // 15 + 1))[:DOCUMENT_BYTES]
    lines = [line(f"big-{i}", f"{i} {text}", LONG_MODEL) for i in range(count)]
    with served(settings) as (client, _):
        uploaded = client.files.create(file=("big.jsonl", jsonl(lines)), purpose="batch")
        before = redis_conn.info("memory")["used_memory"]
        batch_id = start_batch(client, uploaded.id)
        wait_jobs(redis_conn, batch_id, WINDOW)
        time.sleep(1.0)  # a poll or two of the feeder: it must not enqueue more
        assert len(job_states(redis_conn, batch_id)) == WINDOW
        grown = redis_conn.info("memory")["used_memory"] - before
        assert grown <= WINDOW * DOCUMENT_BYTES + margin, grown
        assert spool_path(settings, batch_id).stat().st_size > count * DOCUMENT_BYTES

    defaults = Defaults.of(settings, None, 2)
    text_lines = jsonl(lines).decode().splitlines()
    parsed = parse_batch_lines(text_lines, Path("."), "big", defaults, settings)
    before = redis_conn.info("memory")["used_memory"]
    submit_batch(redis_conn, parsed.items, "big.jsonl", settings=settings)
    whole = redis_conn.info("memory")["used_memory"] - before
    assert whole >= count * DOCUMENT_BYTES, whole


def test_a_cancel_before_every_line_is_enqueued_never_enqueues_the_rest(settings, redis_conn):
    count, window = 10, 3
    settings = settings.model_copy(update={"batch_window": window})
    with served(settings) as (client, _):
        batch_id = create_batch(client, [line(f"c-{i}") for i in range(count)])
        wait_jobs(redis_conn, batch_id, window)
        assert client.batches.cancel(batch_id).status in ("cancelling", "cancelled")
        done = wait_status(client, batch_id, "cancelled")
        assert done.request_counts.model_dump() == {"total": count, "completed": 0, "failed": count}
        errors = file_lines(client, done.error_file_id)
        assert [one["custom_id"] for one in errors] == [f"c-{i}" for i in range(count)]
        assert {one["error"]["code"] for one in errors} == {"cancelled"}
        assert "before this request was enqueued" in errors[-1]["error"]["message"]
        wait_for(lambda: not spool_path(settings, batch_id).exists(), "the spool to go")
        time.sleep(1.0)  # the feeder's polls find nothing to enqueue
    entries = get_batch(redis_conn, batch_id).entries
    assert [bool(redis_conn.exists(keys.job(e.job_id))) for e in entries] == (
        [True] * window + [False] * (count - window)
    )
    assert admit_queue(redis_conn).get_job_ids() == [f"admit-{e.job_id}" for e in entries[:window]]


def test_two_servers_and_racing_feeders_never_enqueue_a_line_twice(settings, redis_conn):
    """Two apps on one Redis and one RINGQ_HOME, and two more feeders feeding as fast as they
    can; the first app stops half-way and the second carries on from the feed's count."""
    count, window, store = 24, 3, JobStore(redis_conn)
    settings = settings.model_copy(update={"batch_window": window})
    stop = threading.Event()

    def race(feeder: BatchFeeder) -> None:
        while not stop.is_set():
            feeder.feed_all()

    racers = [
        threading.Thread(target=race, args=(BatchFeeder(redis_conn, settings),)) for _ in "ab"
    ]
    with ExitStack() as first, served(settings):
        client, _ = first.enter_context(served(settings))
        batch_id = create_batch(client, [line(f"t-{i}") for i in range(count)])
        for racer in racers:
            racer.start()
        try:
            for ended in range(count):
                if ended == count // 2:
                    first.close()  # one server stops; the other and the racers go on
                wait_jobs(redis_conn, batch_id, min(count, ended + window))
                states = job_states(redis_conn, batch_id)
                assert len(unfinished(states)) <= window, states
                finish(store, unfinished(states)[0])
        finally:
            stop.set()
            for racer in racers:
                racer.join()
    admitted = Counter(admit_queue(redis_conn).get_job_ids())
    entries = get_batch(redis_conn, batch_id).entries
    assert admitted == Counter(f"admit-{entry.job_id}" for entry in entries)
    assert batch_counts(redis_conn, get_batch(redis_conn, batch_id)).completed == count


def test_a_lost_spool_fails_the_lines_not_enqueued_and_says_why(settings, redis_conn):
    count, window, store = 6, 3, JobStore(redis_conn)
    settings = settings.model_copy(update={"batch_window": window})
    with served(settings) as (client, _):
        batch_id = create_batch(client, [line(f"l-{i}") for i in range(count)])
        wait_jobs(redis_conn, batch_id, window)
        spool_path(settings, batch_id).unlink()
        for job_id in list(job_states(redis_conn, batch_id)):
            finish(store, job_id)
        done = wait_status(client, batch_id, "completed")
        assert done.request_counts.model_dump() == {"total": count, "completed": 3, "failed": 3}
        errors = file_lines(client, done.error_file_id)
    assert [one["custom_id"] for one in errors] == [f"l-{i}" for i in range(window, count)]
    assert {one["error"]["code"] for one in errors} == {"failed"}
    assert "must share RINGQ_HOME" in errors[0]["error"]["message"]
    assert len(job_states(redis_conn, batch_id)) == window
