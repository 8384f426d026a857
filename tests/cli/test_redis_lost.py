"""A Redis that goes away while a command runs: one line on stderr, no traceback."""

import os
import shutil
import subprocess
import sys
import time

import redis

from jobs.redis_server import connect, ensure_redis
from jobs.schemas import JobKind, JobSpec
from jobs.settings import Settings
from jobs.store import JobStore
from tests.helpers import short_tmp_dir, wait_for


def job_reads(conn: redis.Redis) -> int:
    """HGETALLs the server has run (JobStore.get reads a job's record with one)."""
    stats = conn.info("commandstats")
    return int(stats.get("cmdstat_hgetall", {}).get("calls", 0))


def test_status_watch_when_redis_stops_is_one_line():
    home = short_tmp_dir("ringq-lost-")
    handle = ensure_redis(Settings(home=home, redis_url=None))
    try:
        spec = JobSpec(kind=JobKind.PREFILL, document="text", model="random:tiny-llama")
        conn = connect(handle.url)
        JobStore(conn).create("j1", spec)
        env = {**os.environ, "RINGQ_REDIS_URL": handle.url, "RINGQ_HOME": str(home)}
        reads_before = job_reads(conn)
        watcher = subprocess.Popen(
            [sys.executable, "-m", "cli.main", "status", "j1", "--watch"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

        def watching() -> bool:
            assert watcher.poll() is None, watcher.communicate()
            return job_reads(conn) > reads_before

        # the watcher has read the job once: it is in its loop (a job that never moves: it
        # watches until Redis goes)
        wait_for(watching, "the watcher's first read of the job", timeout_s=60)
        conn.close()
        handle.stop()
        _, stderr = watcher.communicate(timeout=60)
    finally:
        handle.stop()
        shutil.rmtree(home, ignore_errors=True)
    last = stderr.strip().splitlines()[-1]
    assert watcher.returncode == 1, stderr
    assert last.startswith("Error: lost the connection to Redis (") and "ringq up" in last
    assert "Traceback" not in stderr


def test_submit_when_redis_stops_under_it_is_one_line(tmp_path):
    """The issue's own case. Writes are paused (CLIENT PAUSE WRITE), so `ringq submit` has
    connected and checked the job but is blocked on its first write when Redis stops."""
    home = short_tmp_dir("ringq-lost-")
    handle = ensure_redis(Settings(home=home, redis_url=None))
    document = tmp_path / "doc.txt"
    document.write_text("A document.")
    try:
        conn = connect(handle.url)
        conn.execute_command("CLIENT", "PAUSE", 60_000, "WRITE")
        env = {**os.environ, "RINGQ_REDIS_URL": handle.url, "RINGQ_HOME": str(home)}
        args = ["submit", "prefill", str(document), "--model", "random:tiny-llama"]
        submitter = subprocess.Popen(
            [sys.executable, "-m", "cli.main", *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 60
        while not any("b" in c["flags"] for c in conn.client_list()):  # blocked on a write
            assert time.monotonic() < deadline and submitter.poll() is None, submitter.communicate()
            time.sleep(0.05)
        conn.close()
        handle.stop()
        stdout, stderr = submitter.communicate(timeout=60)
    finally:
        handle.stop()
        shutil.rmtree(home, ignore_errors=True)
    assert submitter.returncode == 1, stderr
    assert stdout == ""
    assert stderr.startswith("Error: lost the connection to Redis (") and "ringq up" in stderr
    assert len(stderr.splitlines()) == 1, stderr
