"""A Redis that goes away while a command runs: one line on stderr, no traceback."""

import os
import shutil
import subprocess
import sys

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
