"""`ringq serve` as an attacker holding a key would try it, against a real uvicorn, a real Redis
and real uploads: every route of the app (walked from the app, so a new route is covered) ×
no key, a wrong key, another tenant's key and an admin key; bodies over the limits and nested
too deep; models and paths that name server files, through every entry point."""

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import pytest

from cli.http.guards import SECURITY_HEADERS
from jobs.settings import Settings
from tests.cli.http_serving import serving
from tests.cli.test_http_auth import every_route

ALICE, BOB, ADMIN = "key-alice", "key-bob", "key-admin"
MODEL = "random:tiny-llama"
UPLOAD_LIMIT = 256 * 1024
REQUEST_LIMIT = 64 * 1024


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def chat_body(model: str = MODEL) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def batch_line(custom_id: str, model: str = MODEL, **extra: object) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    line = {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}
    return json.dumps({**line, **extra})


@pytest.fixture(scope="module")
def served(redis_url, tmp_path_factory) -> Iterator[tuple[str, Settings]]:
    home = tmp_path_factory.mktemp("serve-home")
    settings = Settings(
        home=home,
        redis_url=redis_url,
        admin_keys=ADMIN,
        max_upload_bytes=UPLOAD_LIMIT,
        max_request_bytes=REQUEST_LIMIT,
    )
    with serving(settings, redis_url, keys=[ALICE, BOB]) as url:
        yield url, settings


@pytest.fixture(scope="module")
def http(served) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served[0], timeout=60) as client:
        yield client


def upload(http: httpx.Client, key: str, text: str, name: str = "in.jsonl") -> httpx.Response:
    files = {"file": (name, text.encode(), "application/jsonl")}
    return http.post("/v1/files", files=files, data={"purpose": "batch"}, headers=auth(key))


def wait_batch(http: httpx.Client, batch_id: str, key: str) -> dict:
    deadline = time.monotonic() + 60
    while True:
        batch = http.get(f"/v1/batches/{batch_id}", headers=auth(key)).json()
        if batch["status"] != "validating" or time.monotonic() > deadline:
            return batch
        time.sleep(0.1)


@pytest.fixture(scope="module")
def alices(http) -> dict[str, str]:
    """What Alice owns: a file, a batch (and its jobs), a job."""
    file_id = upload(http, ALICE, batch_line("a") + "\n").json()["id"]
    body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions"}
    batch = http.post("/v1/batches", json={**body, "completion_window": "24h"}, headers=auth(ALICE))
    assert batch.status_code == 200, batch.text
    batch_id = batch.json()["id"]
    assert wait_batch(http, batch_id, ALICE)["status"] == "in_progress"
    job = http.post(
        "/api/jobs",
        json={"kind": "prefill", "document": "Alice's document.", "model": MODEL},
        headers=auth(ALICE),
    )
    assert job.status_code == 201, job.text
    return {"file_id": file_id, "batch_id": batch_id, "job_id": job.json()["id"]}


def concrete(path: str, ids: dict[str, str]) -> tuple[str, bool]:
    """The route's path with Alice's ids in it, and whether it reads something of hers (the
    dashboard's /jobs/{job_id} is the same static page for any id: its data comes from
    /api/jobs/{job_id})."""
    owned = False
    for name, value in ids.items():
        if "{" + name in path:
            path, owned = path.replace("{" + name + "}", value), path.startswith(("/v1", "/api"))
    return path.replace("{model_id:path}", "smollm2").replace("{model_id}", "smollm2"), owned


def app_routes(settings: Settings, redis_url: str) -> list[tuple[str, str]]:
    """(method, path template) for every route, DELETE last (it removes what the rest reads)."""
    routes = every_route(settings, redis_url, fill=False)
    return sorted(routes, key=lambda route: route[0] == "DELETE")


def body_for(method: str, path: str, ids: dict[str, str]) -> dict | None:
    if method != "POST":
        return None
    if path == "/v1/batches":
        return {
            "input_file_id": ids["file_id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        }
    if path == "/v1/chat/completions":
        return {**chat_body(), "stream": True}  # answers at once, whatever the job does
    if path == "/api/jobs":
        return {"kind": "prefill", "document": "Bob's own document.", "model": MODEL}
    return {}


def request(http, method, path, key, body):
    headers = {"Accept": "application/json", **(auth(key) if key else {})}
    if path.endswith("/events") or (body or {}).get("stream"):
        with http.stream(method, path, json=body, headers=headers) as response:
            return response.status_code, b"", response.headers  # the head only: it streams
    response = http.request(method, path, json=body, headers=headers)
    return response.status_code, response.content, response.headers


def assert_headers(headers: httpx.Headers, where: object) -> None:
    for name, value in SECURITY_HEADERS:
        assert headers.get(name.decode()) == value.decode(), (where, name)


def test_every_route_for_every_kind_of_caller(served, http, alices, redis_url):
    url, settings = served
    routes = app_routes(settings, redis_url)
    assert len(routes) >= 20
    for method, template in routes:
        path, owned = concrete(template, alices)
        body = body_for(method, template, alices)
        owned |= (method, template) == ("POST", "/v1/batches")  # a batch of Alice's file
        for key in (None, "wrong-key"):
            status, _, headers = request(http, method, path, key, body)
            assert status == 401, (method, path, key, status)
            assert_headers(headers, (method, path))
        status, content, headers = request(http, method, path, BOB, body)
        assert_headers(headers, (method, path))
        if owned:
            assert status == 404, (method, path, "another tenant's", status, content)
        else:
            assert status not in {401, 403}, (method, path, status, content)
            for value in alices.values():  # lists leave Alice's things out
                assert value.encode() not in content, (method, path, value)
        if method == "DELETE" or template == "/v1/batches" and method == "POST":
            continue  # the admin below deletes it; Bob's batch of Alice's file was refused
        status, content, headers = request(http, method, path, ADMIN, body)
        refused = {401, 403} if path.endswith("nothing-here") else {401, 403, 404}
        assert status not in refused, (method, path, "admin", status, content)
        assert_headers(headers, (method, path))
    # The admin sees what Alice has, Alice sees it too, Bob still sees none of it.
    for key, sees in ((ADMIN, True), (ALICE, True), (BOB, False)):
        listed = http.get("/api/jobs?limit=1000", headers=auth(key)).text
        assert (alices["job_id"] in listed) == sees, key
        listed = http.get("/v1/batches?limit=100", headers=auth(key)).text
        assert (alices["batch_id"] in listed) == sees, key
        listed = http.get("/api/batches?limit=100", headers=auth(key)).text
        assert (alices["batch_id"] in listed) == sees, key


def test_another_tenant_cannot_touch_alices_things(served, http, alices):
    job = {"kind": "prefill", "document": "Alice's other document.", "model": MODEL}
    job_id = http.post("/api/jobs", json=job, headers=auth(ALICE)).json()["id"]
    file_id = upload(http, ALICE, batch_line("b") + "\n").json()["id"]
    assert http.post(f"/api/jobs/{job_id}/cancel", headers=auth(BOB)).status_code == 404
    assert http.get(f"/api/jobs/{job_id}", headers=auth(ALICE)).json()["state"] != "cancelled"
    assert http.delete(f"/v1/files/{file_id}", headers=auth(BOB)).status_code == 404
    assert http.get(f"/v1/files/{file_id}/content", headers=auth(ALICE)).status_code == 200
    bobs = http.get(f"/api/jobs?batch={alices['batch_id']}", headers=auth(BOB))
    assert bobs.status_code == 404


def test_uploads_are_bounded_while_they_stream(served, http):
    _, settings = served
    before = (
        set((settings.home / "files").glob("*")) if (settings.home / "files").exists() else set()
    )

    def chunks() -> Iterator[bytes]:  # no Content-Length: the server counts as it reads
        boundary = b"--b0und\r\n"
        yield boundary + b'Content-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        yield boundary + b'Content-Disposition: form-data; name="file"; filename="x.jsonl"\r\n'
        yield b"Content-Type: application/jsonl\r\n\r\n"
        for _ in range(UPLOAD_LIMIT // 4096 + 64):
            yield b"x" * 4096
        yield b"\r\n--b0und--\r\n"

    headers = {**auth(ALICE), "Content-Type": "multipart/form-data; boundary=b0und"}
    response = http.post("/v1/files", content=chunks(), headers=headers)
    assert response.status_code == 413, response.text
    assert "RINGQ_MAX_UPLOAD_BYTES" in response.json()["error"]["message"]
    declared = upload(http, ALICE, "y" * (UPLOAD_LIMIT + 1))  # Content-Length over the limit
    assert declared.status_code == 413
    after = (
        set((settings.home / "files").glob("*")) if (settings.home / "files").exists() else set()
    )
    assert after == before  # nothing of either was kept


def test_request_bodies_are_bounded_and_their_nesting_too(served, http, redis_url):
    _, settings = served
    posts = [path for method, path in app_routes(settings, redis_url) if method == "POST"]
    pad = "z" * (max(REQUEST_LIMIT, UPLOAD_LIMIT) + 1)
    big = json.dumps({**chat_body(), "pad": pad}).encode()
    for template in posts:
        path = template.replace("{batch_id}", "b").replace("{job_id}", "j")
        headers = {**auth(ALICE), "Content-Type": "application/json"}
        response = http.post(path, content=big, headers=headers)
        assert response.status_code == 413, (path, response.status_code)
        streamed = http.post(path, content=iter([big[:4096], big[4096:]]), headers=headers)
        assert streamed.status_code == 413, (path, streamed.status_code)
        deep = http.post(path, content=b"[" * (REQUEST_LIMIT - 1), headers=headers)
        assert deep.status_code == 400, (path, deep.status_code)
        assert "nests deeper" in deep.json()["error"]["message"]


TRICKS = [
    "/etc/passwd",
    "/proc/self/cwd",
    "/proc/self/cwd/pyproject.toml",
    "../../../../etc/hostname",
    "/nonexistent/model.gguf",
    "~root",
    "gpt-4o-mini",
]


def model_refusals(http: httpx.Client, model: str, tiny: Path) -> dict[str, tuple[int, str]]:
    """What each entry point answers for `model`: (status, error message)."""
    found = {}
    response = http.post("/v1/chat/completions", json=chat_body(model), headers=auth(ALICE))
    found["chat"] = (response.status_code, response.json()["error"]["message"])
    job = {"kind": "prefill", "document": "A document.", "model": model}
    response = http.post("/api/jobs", json=job, headers=auth(ALICE))
    found["jobs"] = (response.status_code, response.json()["error"]["message"])
    response = http.get(f"/v1/models/{model}", headers=auth(ALICE))
    found["models"] = (response.status_code, response.json()["error"]["message"])
    for where in ("line", "metadata"):
        line = batch_line("t", model if where == "line" else MODEL)
        file_id = upload(http, ALICE, line + "\n").json()["id"]
        body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions"}
        body |= {"completion_window": "24h"}
        if where == "metadata":
            body["metadata"] = {"model": model}
        created = http.post("/v1/batches", json=body, headers=auth(ALICE)).json()
        batch = wait_batch(http, created["id"], ALICE)
        error = batch["errors"]["data"][0] if batch["errors"] else {}
        found[f"batch {where}"] = (404 if batch["status"] == "failed" else 200, str(error))
    return found


def test_one_model_rule_at_every_entry_point(served, http, tiny_llama_dir):
    """A table: every trick × every entry point is refused alike, and says nothing of the
    server's files (not whether they exist, not where a path leads)."""
    cwd = os.getcwd()
    for model in [*TRICKS, str(tiny_llama_dir), str(tiny_llama_dir / "config.json")]:
        for entry, (status, message) in model_refusals(http, model, tiny_llama_dir).items():
            assert status == 404, (model, entry, status, message)
            said = message.replace(model, "MODEL")
            assert cwd not in said and "resolves" not in said, (model, entry, message)
            for tell in ("exist", "magic", "No such", "Permission", "not found:", "GGUF"):
                assert tell not in said, (model, entry, message)
    for built_in in ("smollm2", MODEL):
        response = http.get(f"/v1/models/{built_in}", headers=auth(ALICE))
        assert response.status_code == 200, response.text


def test_document_paths_name_no_server_file(served, http):
    lines = [
        json.dumps({"custom_id": f"p{i}", "document_path": path})
        for i, path in enumerate(["/etc/passwd", "/proc/self/cwd/README.md", "nothing-here"])
    ]
    file_id = upload(http, ALICE, "\n".join(lines) + "\n").json()["id"]
    body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions"}
    created = http.post(
        "/v1/batches", json={**body, "completion_window": "24h"}, headers=auth(ALICE)
    )
    batch = wait_batch(http, created.json()["id"], ALICE)
    assert batch["status"] == "failed"
    messages = [error["message"] for error in batch["errors"]["data"]]
    assert len(messages) == 3 and all("outside RINGQ_ALLOWED_DIRS" in m for m in messages)
    assert not any(os.getcwd() in m or "root:" in m for m in messages)


def test_errors_speak_http_and_name_the_field(served, http):
    for max_tokens in (0, 32768):
        body = {**chat_body(), "max_tokens": max_tokens}
        response = http.post("/v1/chat/completions", json=body, headers=auth(ALICE))
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == "max_tokens", error
        assert "--" not in error["message"], error
    job = {"kind": "prefill", "document": "Twice.", "model": MODEL, "id": "twice-1"}
    assert http.post("/api/jobs", json=job, headers=auth(ALICE)).status_code == 201
    again = http.post("/api/jobs", json=job, headers=auth(ALICE)).json()["error"]
    assert again["param"] == "id" and "--" not in again["message"], again
