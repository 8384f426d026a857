"""Nothing read from Redis is unpickled: a pickle planted where the dispatcher or the CLI reads a
job is refused as data, never executed, and the services keep running."""

import json
import os
import pickle
import subprocess
import sys
import zlib

from rq.job import Job
from rq.serializers import JSONSerializer

from jobs import keys
from jobs.redis_server import connect
from jobs.submit import admit_queue
from tests.helpers import wait_for


class Exploit:
    """Unpickling this creates `path`: the proof that a pickle was executed."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_the_payload_runs_when_unpickled(tmp_path):
    """The planted payload is live: these tests would see it if anything unpickled it."""
    probe = tmp_path / "probe"
    pickle.loads(pickle.dumps(Exploit(str(probe))))
    assert probe.exists()


def test_a_pickle_in_the_admit_queue_is_never_executed(cluster, tmp_path):
    marker = tmp_path / "executed"
    conn = connect(cluster.url)
    queue = admit_queue(conn)
    job = Job.create(
        "jobs.dispatcher.admit_job",
        args=["planted"],
        connection=conn,
        serializer=JSONSerializer,
        id="planted-pickle",
        origin=queue.name,
    )
    job.save()
    conn.hset(job.key, "data", zlib.compress(pickle.dumps(Exploit(str(marker)))))
    conn.rpush(queue.key, job.id)  # as an attacker with Redis access would
    wait_for(
        lambda: (
            Job.fetch(job.id, connection=conn, serializer=JSONSerializer).get_status() == "failed"
        ),
        "the dispatcher to reject the planted job",
    )
    assert not marker.exists()
    cluster.check_children()  # the dispatcher and both node agents are still running


def test_a_pickle_in_a_job_record_is_a_clear_error(cluster, tmp_path):
    marker = tmp_path / "executed"
    conn = connect(cluster.url)
    conn.hset(
        keys.job("planted"),
        mapping={"id": json.dumps("planted"), "spec": pickle.dumps(Exploit(str(marker)))},
    )
    proc = subprocess.run(
        [sys.executable, "-m", "cli.main", "status", "planted", "--json"],
        capture_output=True,
        text=True,
        env={**os.environ, "RINGQ_REDIS_URL": cluster.url},
        timeout=60,
    )
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip() == "Error: job 'planted': its record in Redis is not valid JSON"
    assert not marker.exists()
