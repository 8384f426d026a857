"""`ringq serve`'s own /api/jobs endpoints on a real cluster, its keys, and its refusal to serve
beyond loopback without them."""

import json
import urllib.request
from collections.abc import Iterator

import openai
import pytest
from click.testing import CliRunner

from cli.main import cli
from jobs.settings import Settings, get_settings
from tests.cli.http_serving import call, serving

MODEL = "random:tiny-llama"


@pytest.fixture(scope="module")
def base_url(cluster) -> Iterator[str]:
    with serving(cluster.settings, cluster.url) as url:
        yield url


def post_json(url: str, payload: object) -> tuple[int, dict, dict]:
    body = json.dumps(payload).encode()
    return call("POST", url, body, {"Content-Type": "application/json"})


def read_events(url: str) -> list[tuple[str, dict]]:
    """Every SSE event of the stream at `url` until it closes (comments skipped)."""
    events, event, data = [], "message", []
    with urllib.request.urlopen(url, timeout=120) as stream:
        for raw in stream:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                event = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data.append(line.removeprefix("data: "))
            elif not line and data:
                events.append((event, json.loads("\n".join(data))))
                event, data = "message", []
    return events


def test_submit_follow_and_read_a_job(base_url):
    status, job, _ = post_json(
        f"{base_url}/api/jobs",
        {
            "kind": "generate",
            "document": "Rings pass blocks. " * 40,
            "model": MODEL,
            "max_tokens": 5,
            "prompt": "Why?",
        },
    )
    assert status == 201, job
    assert job["state"] == "queued" and "spec" not in job

    events = read_events(f"{base_url}/api/jobs/{job['id']}/events")
    kinds = [kind for kind, _ in events]
    assert kinds[-1] == "end" and set(kinds[:-1]) <= {"progress", "text"}
    order = ["queued", "admitted", "loading", "prefill", "decode", "finished"]
    views = [data for kind, data in events if kind != "text"]
    phases = [order.index(data["progress"]["phase"]) for data in views]
    assert phases == sorted(phases), "phases arrive in lifecycle order"
    final = events[-1][1]
    assert final["state"] == "finished" and final["result"]["generated_tokens"] >= 1
    streamed = "".join(data["text"] for kind, data in events if kind == "text")
    assert streamed == final["result"]["text"], "the text events add up to the answer"

    status, full, _ = call("GET", f"{base_url}/api/jobs/{job['id']}")
    assert status == 200
    assert full["spec"]["prompt"] == "Why?" and "document" not in full["spec"]
    assert full["spec"]["document_chars"] == len("Rings pass blocks. " * 40)
    assert isinstance(full["result"]["text"], str)

    status, listed, _ = call("GET", f"{base_url}/api/jobs?state=finished&limit=500")
    assert status == 200 and job["id"] in [row["id"] for row in listed["data"]]
    status, error, _ = call("POST", f"{base_url}/api/jobs/{job['id']}/cancel")
    assert status == 409 and "already finished" in error["error"]["message"]


def test_bad_jobs_get_openai_shaped_errors(base_url):
    status, error, _ = post_json(f"{base_url}/api/jobs", {"kind": "generate", "document": " "})
    assert status == 400 and error["error"]["param"] == "document"
    status, error, _ = post_json(
        f"{base_url}/api/jobs", {"kind": "prefill", "document": "x", "model": "/etc"}
    )
    assert status == 404 and "RINGQ_ALLOWED_DIRS" in error["error"]["message"]
    status, error, _ = call("GET", f"{base_url}/api/jobs/no-such-job")
    assert (status, error["error"]["code"]) == (404, "not_found")
    status, error, _ = call("GET", f"{base_url}/api/jobs?state=sleeping")
    assert status == 400 and error["error"]["param"] == "state"


def test_keys_are_required_on_every_route_when_set(redis_url, redis_conn):
    settings = Settings(home=get_settings().home, redis_url=redis_url)
    with serving(settings, redis_url, keys=["k-one", "k-two"]) as url:
        refused = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as exc:
            refused.models.list()
        assert exc.value.code == "invalid_api_key"
        allowed = openai.OpenAI(base_url=f"{url}/v1", api_key="k-two", max_retries=0)
        assert "random:tiny-llama" in [m.id for m in allowed.models.list()]
        for path in ("/", "/static/dashboard.js", "/api/overview", "/api/jobs"):
            status, body, headers = call("GET", f"{url}{path}")
            assert status == 401 and body["error"]["type"] == "authentication_error", path
            assert headers["www-authenticate"] == "Bearer"
        status, _, _ = call("GET", f"{url}/api/overview", headers={"Authorization": "Bearer k-one"})
        assert status == 200


def test_dashboard_key_in_the_address_becomes_a_cookie(redis_url, redis_conn):
    settings = Settings(home=get_settings().home, redis_url=redis_url)
    with serving(settings, redis_url, keys=["k-one"]) as url:
        opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor())
        with opener.open(f"{url}/?key=k-one") as page:  # 303 to / with the cookie, then the page
            assert page.url == f"{url}/" and b"dashboard.js" in page.read()
        with opener.open(f"{url}/api/overview") as overview:
            assert json.loads(overview.read())["nodes"] == []


def test_serve_refuses_a_public_address_without_keys(monkeypatch):
    monkeypatch.delenv("RINGQ_API_KEYS", raising=False)
    get_settings.cache_clear()
    result = CliRunner().invoke(cli, ["serve", "--host", "0.0.0.0"])
    get_settings.cache_clear()
    assert result.exit_code == 2
    assert "refusing to serve on 0.0.0.0 without API keys" in result.output
    assert "Traceback" not in result.output
