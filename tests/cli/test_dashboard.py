"""The dashboard in a real browser (Debian's chromium driven by Playwright) against a real
cluster: a running job's progress bar advances on the list page and on the job's own page (SSE),
and jobs are cancelled with the page's buttons. Screenshots go to RINGQ_SCREENSHOT_DIR when set
(docs/ holds the committed ones), else to a temporary directory."""

import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.cli.http_serving import call, serving

MODEL = "random:tiny-llama"
LONG_DOCUMENT = "Ring attention passes key and value blocks around a ring of ranks. " * 150
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
WAIT_MS = 120_000

pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="Debian's chromium is not installed (`apt-get install chromium` as root; "
    "`./dev test` installs it)",
)
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")


@pytest.fixture(scope="module")
def base_url(cluster) -> Iterator[str]:
    with serving(cluster.settings, cluster.url) as url:
        yield url


@pytest.fixture
def page(base_url) -> Iterator:
    with sync_api.sync_playwright() as playwright:
        # not the OpenBLAS that `./dev test` preloads for MLX: chromium hung with it
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox"], env=env, timeout=60_000
        )
        try:
            context = browser.new_context(viewport={"width": 1500, "height": 1000})
            page = context.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.on("requestfailed", lambda request: note_failure(errors, request))
            yield page
            assert errors == [], "the page had script errors or failed requests"
        finally:
            browser.close()


def note_failure(errors: list[str], request) -> None:
    """A request that failed, except those a navigation aborted (polls, event streams)."""
    if "ERR_ABORTED" not in (request.failure or ""):
        errors.append(f"{request.url}: {request.failure}")


@pytest.fixture
def shots(tmp_path) -> Path:
    where = Path(os.environ.get("RINGQ_SCREENSHOT_DIR") or tmp_path)
    where.mkdir(parents=True, exist_ok=True)
    return where


def submit(base_url: str, document: str, max_tokens: int, prompt: str | None = None) -> str:
    spec = {"kind": "generate", "document": document, "model": MODEL, "max_tokens": max_tokens}
    if prompt is not None:
        spec["prompt"] = prompt
    status, job, _ = call(
        "POST",
        f"{base_url}/api/jobs",
        json.dumps(spec).encode(),
        {"Content-Type": "application/json"},
    )
    assert status == 201, job
    return job["id"]


def submit_batch(base_url: str) -> str:
    """A batch of two short requests through /v1/files and /v1/batches."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    lines = [
        {
            "custom_id": f"q{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"Hi {i}"}],
                "max_tokens": 8,
            },
        }
        for i in range(2)
    ]
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = client.files.create(file=("hello.jsonl", content), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    return batch.id


def job_state(base_url: str, job_id: str) -> str:
    return call("GET", f"{base_url}/api/jobs/{job_id}")[1]["state"]


def wait_state(base_url: str, job_id: str, states: set[str], timeout_s: float = 120) -> str:
    deadline = time.monotonic() + timeout_s
    while (state := job_state(base_url, job_id)) not in states:
        assert time.monotonic() < deadline, f"job {job_id} still {state}"
        time.sleep(0.1)
    return state


def watch_advance(page, bar_selector: str) -> list[int]:
    """Token counts the bar shows until it has shown three different ones while running."""
    seen: list[int] = []
    deadline = time.monotonic() + WAIT_MS / 1000
    while len(set(seen)) < 3:
        assert time.monotonic() < deadline, f"progress did not advance: {seen}"
        bar = page.locator(bar_selector)
        if bar.count():
            processed = int(bar.first.get_attribute("data-processed") or 0)
            classes = bar.first.get_attribute("class") or ""
            assert not any(s in classes for s in ("finished", "failed", "cancelled")), seen
            if processed > 0 and (not seen or processed != seen[-1]):
                seen.append(processed)
        page.wait_for_timeout(100)
    return seen


def test_dashboard_follows_and_cancels_jobs(base_url, page, shots):
    done_id = submit(base_url, "A short note about rings. " * 20, 12, prompt="What is it?")
    wait_state(base_url, done_id, {"finished"})
    batch_id = submit_batch(base_url)
    running_id = submit(base_url, LONG_DOCUMENT, 4000)
    try:
        page.goto(base_url)
        row = f'#jobs tr[data-job-id="{running_id}"]'
        page.wait_for_selector(row, timeout=WAIT_MS)
        seen = watch_advance(page, f"{row} .progress")
        assert seen == sorted(seen), "the bar only moves forward"
        assert page.locator(f'#jobs tr[data-job-id="{done_id}"] .state').inner_text() == "finished"
        assert page.locator("#nodes tbody tr").count() == 2
        assert "running" in page.locator("#groups").inner_text()
        batch_row = page.locator(f'#batches tr[data-batch-id="{batch_id}"]')
        assert batch_row.locator("td").nth(3).inner_text().endswith("/2")  # done/total
        page.screenshot(path=str(shots / "dashboard.png"), full_page=True)

        page.locator(f"{row} button.cancel").click()
        page.wait_for_function(
            'id => document.querySelector(`#jobs tr[data-job-id="${id}"] .state`)'
            "?.textContent === 'cancelled'",
            arg=running_id,
            timeout=WAIT_MS,
        )
        assert job_state(base_url, running_id) == "cancelled"
    finally:
        call("POST", f"{base_url}/api/jobs/{running_id}/cancel")


def test_job_page_shows_timeline_progress_and_result(base_url, page, shots):
    done_id = submit(base_url, "A short note about rings. " * 20, 12, prompt="What is it?")
    wait_state(base_url, done_id, {"finished"})
    page.goto(f"{base_url}/jobs/{done_id}")
    page.wait_for_selector('#timeline li[data-phase="finished"].done', timeout=WAIT_MS)
    phases = page.locator("#timeline li").evaluate_all("items => items.map(i => i.dataset.phase)")
    assert phases == ["queued", "admitted", "loading", "prefill", "decode", "finished"]
    result = call("GET", f"{base_url}/api/jobs/{done_id}")[1]["result"]["text"]
    assert page.locator("#job-result").inner_text() == result
    assert page.locator("#job-cancel").is_hidden()
    page.screenshot(path=str(shots / "dashboard-job.png"), full_page=True)

    running_id = submit(base_url, LONG_DOCUMENT, 4000)
    try:
        page.goto(f"{base_url}/jobs/{running_id}")
        watch_advance(page, "#job-progress .progress")  # live through the SSE stream
        page.screenshot(path=str(shots / "dashboard-job-running.png"), full_page=True)
        page.locator("#job-cancel").click()
        page.wait_for_selector("#job-state .state.cancelled", timeout=WAIT_MS)
        page.wait_for_selector('#timeline li[data-phase="cancelled"].ended-bad')
        assert job_state(base_url, running_id) == "cancelled"
    finally:
        call("POST", f"{base_url}/api/jobs/{running_id}/cancel")


def test_a_long_model_path_leaves_the_cancel_button_on_a_1280_px_screen(cluster, base_url, page):
    """The job list shows a model path's last part (the whole path on hover), so the progress
    and Cancel columns stay on a 1280-px screen. The job is recorded and never enqueued: it
    waits, queued, with its Cancel button, until the test cancels it."""
    from jobs.redis_server import connect
    from jobs.schemas import JobKind, JobSpec
    from jobs.store import JobStore

    model = (
        "/srv/models/" + "a-very-long-directory-name/" * 4 + "Qwen2.5-7B-Instruct-1M-Q4_K_M.gguf"
    )
    store = JobStore(connect(cluster.url))
    job_id = "longpath" + str(int(time.time()))
    store.create(job_id, JobSpec(kind=JobKind.PREFILL, document="x", model=model))
    page.set_viewport_size({"width": 1280, "height": 900})
    page.goto(base_url)
    cell = page.locator(f"tr:has(a:text('{job_id}')) td.model")
    cell.wait_for(timeout=WAIT_MS)
    assert cell.inner_text() == "Qwen2.5-7B-Instruct-1M-Q4_K_M.gguf"
    assert cell.get_attribute("title") == model
    button = page.locator(f"button.cancel[data-job-id='{job_id}']")
    box = button.bounding_box()
    assert box is not None and box["x"] + box["width"] <= 1280
    button.click()
    deadline = time.monotonic() + 60
    while job_state(base_url, job_id) != "cancelled":
        assert time.monotonic() < deadline, "the job was not cancelled"
        time.sleep(0.2)
