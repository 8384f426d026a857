"""`ringq serve` through the official `openai` package, unchanged but for base_url, against a
real cluster (Redis, dispatcher, two node agents, rank processes) and a tiny random model."""

import json
import time
from collections.abc import Iterator

import openai
import pytest

from jobs.lifecycle import FINAL_STATES
from jobs.redis_server import connect
from tests.cli.http_serving import call, serving
from tests.helpers import long_stream

MODEL = "random:tiny-llama"
WAIT_S = 180
FINAL = {state.value for state in FINAL_STATES}


@pytest.fixture(scope="module")
def base_url(cluster) -> Iterator[str]:
    with serving(cluster.settings, cluster.url) as url:
        yield url


@pytest.fixture
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def batch_line(custom_id: str, question: str, max_tokens: int = 4, model: str = "gpt-4o-mini"):
    body = {
        "model": model,
        "messages": [
            {"role": "system", "content": "Ring attention splits a prompt over machines."},
            {"role": "user", "content": question},
        ],
        "max_tokens": max_tokens,
    }
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def jsonl(lines) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def wait_batch(client: openai.OpenAI, batch_id: str, statuses: set[str]):
    deadline = time.monotonic() + WAIT_S
    seen: list[str] = []
    while True:
        batch = client.batches.retrieve(batch_id)
        if not seen or seen[-1] != batch.status:
            seen.append(batch.status)
        if batch.status in statuses:
            return batch, seen
        assert time.monotonic() < deadline, (
            batch_id,
            seen,
            batch.request_counts,
            errors(client, batch),
        )
        time.sleep(0.2)


def errors(client: openai.OpenAI, batch) -> str | None:
    """The batch's error file, for a failure message."""
    return client.files.content(batch.error_file_id).text if batch.error_file_id else None


def test_batch_from_upload_to_output_file(client):
    lines = [batch_line(f"req-{i}", f"Question {i}?") for i in range(3)]
    uploaded = client.files.create(file=("requests.jsonl", jsonl(lines)), purpose="batch")
    assert (uploaded.purpose, uploaded.bytes, uploaded.filename) == (
        "batch",
        len(jsonl(lines)),
        "requests.jsonl",
    )
    assert client.files.retrieve(uploaded.id).id == uploaded.id
    assert uploaded.id in [f.id for f in client.files.list(purpose="batch")]

    batch = client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"model": MODEL},  # the lines name gpt-4o-mini: run them on a ringq model
    )
    assert batch.status in ("validating", "in_progress")
    assert batch.input_file_id == uploaded.id
    done, seen = wait_batch(client, batch.id, {"completed", "failed", "cancelled"})
    why = (seen, done.errors, errors(client, done))  # each request's error: this failed once
    assert done.status == "completed", why
    assert done.request_counts.model_dump() == {"total": 3, "completed": 3, "failed": 0}, why
    assert done.error_file_id is None
    assert done.completed_at is not None and done.completed_at >= done.created_at

    output = [
        json.loads(line)
        for line in client.files.content(done.output_file_id).text.split("\n")
        if line
    ]
    assert [line["custom_id"] for line in output] == ["req-0", "req-1", "req-2"]
    for line in output:
        body = line["response"]["body"]
        assert line["response"]["status_code"] == 200 and line["error"] is None
        assert body["object"] == "chat.completion" and body["model"] == MODEL
        usage = body["usage"]
        assert 1 <= usage["completion_tokens"] <= 4
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert isinstance(body["choices"][0]["message"]["content"], str)
    assert done.id in [b.id for b in client.batches.list()]

    assert client.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)


def test_invalid_lines_fail_the_batch_naming_them(client):
    lines = [batch_line("a", "One?"), {"custom_id": "b", "oops": True}, batch_line("c", "Two?")]
    uploaded = client.files.create(file=("bad.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    failed, _ = wait_batch(client, batch.id, {"failed", "in_progress", "completed"})
    assert failed.status == "failed"
    errors = failed.errors.data
    assert [e.line for e in errors] == [None, 2]  # one error for the lines naming gpt-4o-mini
    assert errors[0].code == "model_not_found" and "line(s) 1, 3" in errors[0].message
    assert "gpt-4o-mini" in errors[0].message and "RINGQ_MODEL_ALIASES" in errors[0].message
    assert "metadata={'model'" in errors[0].message
    assert failed.output_file_id is None


def test_cancel_a_batch_puts_its_lines_in_the_error_file(client):
    long_question = "Explain ring attention in detail. " * 200
    # max_tokens far above what a tiny model decodes before the cancel lands: on a warm group
    # four 64-token lines (batched) once finished first, and the batch completed
    lines = [batch_line(f"slow-{i}", long_question, max_tokens=4000, model=MODEL) for i in range(4)]
    uploaded = client.files.create(file=("slow.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    wait_batch(client, batch.id, {"in_progress"})
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done, seen = wait_batch(client, batch.id, {"cancelled"})
    counts = done.request_counts
    assert counts.total == 4 and counts.completed + counts.failed == 4 and counts.failed >= 1
    errors = [
        json.loads(line) for line in client.files.content(done.error_file_id).text.splitlines()
    ]
    assert len(errors) == counts.failed
    assert {e["error"]["code"] for e in errors} == {"cancelled"}
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)


def test_a_batch_fed_two_jobs_at_a_time_answers_every_line_in_order(cluster):
    """RINGQ_BATCH_WINDOW=2: the server keeps at most two of the batch's jobs unfinished in
    Redis, enqueueing the next lines as the cluster finishes earlier ones."""
    settings = cluster.settings.model_copy(update={"batch_window": 2})
    conn = connect(cluster.url)
    with serving(settings, cluster.url) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        lines = [batch_line(f"w-{i}", f"Question {i}?", model=MODEL) for i in range(5)]
        uploaded = client.files.create(file=("window.jsonl", jsonl(lines)), purpose="batch")
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        deadline, most = time.monotonic() + WAIT_S, 0
        while (done := client.batches.retrieve(batch.id)).status not in ("completed", "failed"):
            states = [conn.hget(f"ringq:job:{batch.id}-{n}", "state") for n in range(1, 6)]
            most = max(most, sum(s is not None and json.loads(s) not in FINAL for s in states))
            assert time.monotonic() < deadline, (done.status, done.request_counts)
            time.sleep(0.1)
        assert done.status == "completed", errors(client, done)
        text = client.files.content(done.output_file_id).text
    conn.close()
    assert 1 <= most <= 2
    output = [json.loads(line) for line in text.splitlines()]
    assert [line["custom_id"] for line in output] == [f"w-{i}" for i in range(5)]


def test_chat_completion_with_and_without_stream(client):
    messages = [
        {"role": "system", "content": "A document about rings. " * 20},
        {"role": "user", "content": "What is it about?"},
    ]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6)
    text = whole.choices[0].message.content
    assert whole.object == "chat.completion" and isinstance(text, str)
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage.completion_tokens >= 1

    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text, "greedy decoding: the same answer streamed or not"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and set(finishes[:-1]) == {None}
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1


def test_models_and_errors_in_openai_shape(client, base_url):
    assert MODEL in [m.id for m in client.models.list()]
    with pytest.raises(openai.NotFoundError) as not_found:
        client.chat.completions.create(
            model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}]
        )
    assert not_found.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "assistant", "content": "hi"}]
        )
    assert "role 'assistant' is not supported" in str(bad.value)
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch-nope")
    with pytest.raises(openai.BadRequestError) as wrong_endpoint:
        client.batches.create(
            input_file_id="file-x", endpoint="/v1/embeddings", completion_window="24h"
        )
    assert wrong_endpoint.value.param == "endpoint"

    status, body, _ = call("POST", f"{base_url}/v1/chat/completions", b"{not json")
    assert status == 400
    assert set(body["error"]) == {"message", "type", "param", "code"}
    status, body, _ = call("GET", f"{base_url}/v1/nowhere")
    assert (status, body["error"]["type"]) == (404, "invalid_request_error")


def test_a_stream_closed_early_cancels_its_job(client, base_url):
    stream = long_stream(client, MODEL)
    first = next(iter(stream))
    job_id = first.id.removeprefix("chatcmpl-")
    stream.close()
    deadline = time.monotonic() + WAIT_S
    while (state := call("GET", f"{base_url}/api/jobs/{job_id}")[1]["state"]) != "cancelled":
        assert state not in ("finished", "failed"), state
        assert time.monotonic() < deadline, f"job {job_id} still {state}"
        time.sleep(0.1)
