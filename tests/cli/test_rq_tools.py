"""RQ's own tools read ringq's queues: they are plain RQ queues of JSON-serialized jobs, so
`rq info` and rq-dashboard work on them unchanged (nothing needs pickle)."""

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest

from jobs.schemas import JobKind, JobSpec
from jobs.submit import submit_job

JOB_COUNT = 3
READY_TIMEOUT_S = 30.0
RQ_BIN = Path(sys.executable).with_name("rq")
RQ_INFO_QUEUE = re.compile(r"^queue (\S+) (\d+),", re.MULTILINE)


@pytest.fixture
def submitted(redis_conn) -> list[str]:
    """A few jobs on ringq:admit; no dispatcher runs, so they stay queued."""
    spec = JobSpec(kind=JobKind.PREFILL, document="A document.", model="random:tiny-llama")
    return [submit_job(redis_conn, spec).id for _ in range(JOB_COUNT)]


def test_rq_info_lists_the_admit_queue(redis_url, submitted):
    proc = subprocess.run(
        [str(RQ_BIN), "info", "--url", redis_url, "--serializer", "json", "--only-queues", "--raw"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    # --raw lines: "queue ringq:admit 3, 0 executing, 0 finished, 0 failed"
    counts = dict(RQ_INFO_QUEUE.findall(proc.stdout))
    assert counts == {"ringq:admit": str(JOB_COUNT)}, proc.stdout


@pytest.fixture
def dashboard(redis_url, redis_conn, tmp_path) -> Iterator[str]:
    """rq-dashboard (with its JSON serializer) on a free loopback port; its base URL. It takes
    the unix:// URL of the test Redis as it is (redis-py's from_url)."""
    port = free_port()
    log_path = tmp_path / "rq-dashboard.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "rq_dashboard", "--bind", "127.0.0.1", "--port", str(port)]
            + ["--redis-url", redis_url, "--json"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(base, process, log_path)
        yield base
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_rq_dashboard_serves_ringq_queues_and_jobs(dashboard, submitted):
    queues = {q["name"]: q for q in fetch_json(f"{dashboard}/0/data/queues.json")["queues"]}
    assert queues["ringq:admit"]["count"] == JOB_COUNT
    assert queues["ringq:admit"]["failed_job_registry_count"] == 0
    # Listing the jobs makes the dashboard deserialize them: JSON in, no pickle.
    listing = fetch_json(f"{dashboard}/0/data/jobs/{quote('ringq:admit')}/queued/8/asc/1.json")
    assert sorted(job["id"] for job in listing["jobs"]) == sorted(f"admit-{i}" for i in submitted)
    assert all("jobs.dispatcher.admit_job" in job["description"] for job in listing["jobs"])


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def fetch_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def wait_until_serving(base: str, process: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        if process.poll() is not None:
            output = log_path.read_text(errors="replace")
            raise AssertionError(f"rq-dashboard exited with {process.returncode}:\n{output}")
        try:
            fetch_json(f"{base}/0/data/queues.json")
            return
        except (urllib.error.URLError, ConnectionError):
            assert time.monotonic() < deadline, "rq-dashboard did not answer in time"
            time.sleep(0.2)
