"""`ringq serve`'s files and the checks made before any job runs (no cluster needed: nothing is
enqueued), through the official `openai` package; its pure helpers as tables."""

import time
from collections.abc import Iterator

import openai
import pytest

from cli.http.auth import check_bind, host_name, is_loopback, key_matches, parse_keys
from cli.http.batch_objects import VALIDATION_TIMEOUT_S, OpenAIBatchRecord, save
from jobs import batch as job_batches
from jobs.batch_input import BatchItem
from jobs.schemas import JobKind, JobSpec
from jobs.settings import Settings, get_settings
from tests.cli.http_serving import call, serving


@pytest.fixture
def client(redis_url, redis_conn) -> Iterator[openai.OpenAI]:
    settings = Settings(home=get_settings().home, redis_url=redis_url)
    with serving(settings, redis_url) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_files_list_in_pages_and_delete(client):
    ids = [
        client.files.create(file=(f"f{i}.jsonl", b'{"a": 1}\n'), purpose="batch").id
        for i in range(5)
    ]
    first = client.files.list(limit=2)
    assert [f.id for f in first.data] == ids[::-1][:2] and first.has_more
    every = [f.id for f in client.files.list(limit=2)]  # the client follows `after` itself
    assert every == ids[::-1]
    oldest_first = client.files.list(order="asc")
    assert [f.id for f in oldest_first.data] == ids
    assert client.files.content(ids[0]).content == b'{"a": 1}\n'
    assert client.files.delete(ids[0]).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.content(ids[0])
    with pytest.raises(openai.NotFoundError):
        client.files.delete(ids[0])


def test_uploads_are_checked(client):
    with pytest.raises(openai.BadRequestError) as wrong_purpose:
        client.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
    assert wrong_purpose.value.param == "purpose"
    with pytest.raises(openai.BadRequestError) as empty:
        client.files.create(file=("x.jsonl", b"\n\n"), purpose="batch")
    assert "empty" in str(empty.value)


def test_batch_creation_is_checked(client):
    uploaded = client.files.create(file=("x.jsonl", b"{}\n"), purpose="batch")
    with pytest.raises(openai.BadRequestError) as window:
        client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="1h"
        )
    assert window.value.param == "completion_window"
    with pytest.raises(openai.NotFoundError):
        client.batches.create(
            input_file_id="file-missing", endpoint="/v1/chat/completions", completion_window="24h"
        )


def test_a_document_path_on_the_server_is_refused(client):
    line = b'{"custom_id": "a", "document_path": "/etc/hostname", "model": "random:tiny-llama"}\n'
    uploaded = client.files.create(file=("paths.jsonl", line), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    for _ in range(100):
        batch = client.batches.retrieve(batch.id)
        if batch.status != "validating":
            break
    assert batch.status == "failed"
    assert "outside RINGQ_ALLOWED_DIRS" in batch.errors.data[0].message


def test_chat_checks_its_request_before_any_job(client):
    base = str(client.base_url).removesuffix("/v1/")
    status, error, _ = call(
        "POST", f"{base}/v1/chat/completions", b"[1, 2]", {"Content-Type": "application/json"}
    )
    assert status == 400 and "JSON object" in error["error"]["message"]
    with pytest.raises(openai.BadRequestError) as no_model:
        client.chat.completions.create(model="", messages=[{"role": "user", "content": "hi"}])
    assert no_model.value.param == "model"
    with pytest.raises(openai.NotFoundError) as path_model:
        client.chat.completions.create(model="/tmp", messages=[{"role": "user", "content": "x"}])
    assert "RINGQ_ALLOWED_DIRS" in str(path_model.value)


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("192.168.1.10", False),
        ("example.com", False),
    ],
)
def test_loopback_addresses(host, loopback):
    assert is_loopback(host) is loopback
    if loopback:
        check_bind(host, [])
    else:
        with pytest.raises(ValueError, match="RINGQ_API_KEYS"):
            check_bind(host, [])
    check_bind(host, ["a-key"])  # with keys, anywhere


@pytest.mark.parametrize(
    ("raw", "keys"),
    [(None, []), ("", []), ("a", ["a"]), (" a , b,,", ["a", "b"]), (",", [])],
)
def test_parse_keys(raw, keys):
    assert parse_keys(raw) == keys


def test_key_matching():
    assert key_matches("b", ["a", "b"])
    assert not key_matches("c", ["a", "b"])
    assert not key_matches("", ["a"]) and not key_matches(None, ["a"])
    assert not key_matches("ab", ["a"])


def test_a_batch_left_validating_by_a_stopped_server_fails(client, redis_conn):
    long_ago = int(time.time()) - VALIDATION_TIMEOUT_S - 1
    record = OpenAIBatchRecord(
        id="batch-abandoned",
        endpoint="/v1/chat/completions",
        input_file_id="file-gone",
        completion_window="24h",
        created_at=long_ago,
    )
    save(redis_conn, record, ttl_s=60)
    batch = client.batches.retrieve("batch-abandoned")
    assert batch.status == "failed"
    assert batch.errors.data[0].code == "validation_interrupted"
    recent = record.model_copy(update={"id": "batch-recent", "created_at": int(time.time())})
    save(redis_conn, recent, ttl_s=60)
    assert client.batches.retrieve("batch-recent").status == "validating"


def test_a_batch_read_while_its_jobs_are_written_stays_validating(client, redis_conn):
    """The batch's record is claimed before its jobs are written: a reader in between once took
    the missing jobs for expired ones and finished the batch, all its requests failed."""
    record = OpenAIBatchRecord(
        id="batch-mid-way",
        endpoint="/v1/chat/completions",
        input_file_id="file-x",
        completion_window="24h",
        created_at=int(time.time()),
    )
    save(redis_conn, record, ttl_s=60)
    spec = JobSpec(
        kind=JobKind.PREFILL, document="hi", document_name="d", model="random:tiny-llama"
    )
    items = [BatchItem(n, f"c{n}", spec.model_copy(update={"custom_id": f"c{n}"})) for n in (1, 2)]
    written: list = []
    real_enqueue = job_batches.enqueue_jobs
    job_batches.enqueue_jobs = lambda conn, jobs, **_: written.extend(jobs)  # claimed, not written
    try:
        job_batches.submit_batch(redis_conn, items, "in.jsonl", batch_id="batch-mid-way")
    finally:
        job_batches.enqueue_jobs = real_enqueue
    mid_way = client.batches.retrieve("batch-mid-way")
    assert (mid_way.status, mid_way.request_counts.failed) == ("validating", 0)
    real_enqueue(redis_conn, written)
    assert client.batches.retrieve("batch-mid-way").status == "in_progress"


def test_other_web_pages_cannot_drive_the_api(client):
    base = str(client.base_url).removesuffix("/v1/")
    job = b'{"kind": "prefill", "document": "x", "model": "random:tiny-llama"}'
    evil = {"Origin": "http://evil.example", "Content-Type": "text/plain"}
    status, error, _ = call("POST", f"{base}/api/jobs", job, evil)
    assert (status, error["error"]["code"]) == (403, "forbidden")
    status, error, _ = call("GET", f"{base}/api/overview", headers={"Host": "evil.example"})
    assert status == 403 and "loopback" in error["error"]["message"]
    same_origin = {"Origin": base, "Content-Type": "application/json"}
    status, created, _ = call("POST", f"{base}/api/jobs", job, same_origin)
    assert status == 201, created


@pytest.mark.parametrize(
    ("header", "name"),
    [("a:8000", "a"), ("a", "a"), ("[::1]:8000", "[::1]"), ("[::1]", "[::1]"), ("", "")],
)
def test_host_name(header, name):
    assert host_name(header) == name


def test_a_batch_cancelled_at_once_ends_cancelled(client):
    line = (
        b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": '
        b'{"model": "random:tiny-llama", "messages": [{"role": "user", "content": "hi"}]}}\n'
    )
    uploaded = client.files.create(file=("one.jsonl", line), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    deadline = time.monotonic() + 120
    while (batch := client.batches.retrieve(batch.id)).status != "cancelled":
        assert batch.status == "cancelling", batch.status
        assert time.monotonic() < deadline, "still cancelling"
        time.sleep(0.05)
    assert batch.request_counts.completed == 0
    assert batch.cancelled_at is not None and batch.output_file_id is None
