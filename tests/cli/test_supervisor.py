"""`ringq up` restarts a dispatcher, node agent or embedded Redis that dies, records the restarts
for `ringq top`, and leaves a crash-looping service stopped with a message naming its log."""

import json
import os
import shutil
import signal
import subprocess
import sys

import psutil
import pytest

from cli.services import LocalCluster
from cli.supervisor import RestartPolicy, Supervisor, services_line
from jobs.lifecycle import JobState
from jobs.redis_server import SOCKET_NAME, connect, is_alive, shutdown_embedded, unix_url
from jobs.schemas import JobKind, JobSpec
from jobs.service_status import ServiceState, read_service_statuses
from jobs.settings import Settings
from jobs.store import JobStore
from jobs.submit import submit_job
from tests.cli.test_up import ready_line_seen
from tests.helpers import child_pid, final_record, short_tmp_dir, wait_for

MODEL = "random:tiny-llama"


@pytest.mark.parametrize(
    ("recent_restarts", "expected_s"),
    [(0, 0.5), (1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (5, None), (9, None)],
)
def test_backoff_doubles_until_the_crash_loop_limit(recent_restarts, expected_s):
    assert RestartPolicy().backoff_s(recent_restarts) == expected_s


def test_backoff_is_capped():
    policy = RestartPolicy(max_restarts=10, first_backoff_s=1.0, max_backoff_s=3.0)
    assert [policy.backoff_s(n) for n in range(4)] == [1.0, 2.0, 3.0, 3.0]


def test_up_restarts_killed_services_and_jobs_still_finish():
    home = short_tmp_dir("ringq-sup-")
    env = {k: v for k, v in os.environ.items() if k != "RINGQ_REDIS_URL"}
    env.update(RINGQ_HOME=str(home), RINGQ_NODE_TTL_S="3", RINGQ_NODE_HEARTBEAT_S="0.5")
    up = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "up", "--nodes", "1"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = unix_url(home / "redis" / SOCKET_NAME)
    try:
        printed: list[str] = []
        wait_for(lambda: ready_line_seen(up, printed), "`ringq up` to say it is ready")
        conn = connect(url, ride_out_s=30)
        services = {s.label: s for s in wait_for(lambda: read_service_statuses(conn), "statuses")}
        assert set(services) == {"dispatcher", "node-0", "redis"}
        for label in ("dispatcher", "node-0", "redis"):
            os.kill(services[label].pid, signal.SIGKILL)
            wait_for(lambda name=label: restarted(conn, name), f"{label} to be restarted", 30)
        record = submit_job(
            conn, JobSpec(kind=JobKind.PREFILL, document="a note " * 20, model=MODEL)
        )
        end = wait_for(lambda: final_record(JobStore(conn), record.id), "the job", 120)
        assert end.state == JobState.FINISHED, end.error
        top = subprocess.run(
            [sys.executable, "-m", "cli.main", "top", "--json"], env=env, capture_output=True
        )
        shown = {s["label"]: s["restarts"] for s in json.loads(top.stdout)["services"]}
        assert shown == {"dispatcher": 1, "node-0": 1, "redis": 1}
        children = psutil.Process(up.pid).children(recursive=True)
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=30) == 0
        assert not [c for c in children if c.is_running() and c.status() != "zombie"]
        assert not is_alive(url)
    finally:
        if up.poll() is None:
            up.kill()
        shutdown_embedded(Settings(home=home, redis_url=None))
        shutil.rmtree(home, ignore_errors=True)


def restarted(conn, label: str) -> bool:
    status = {s.label: s for s in read_service_statuses(conn)}[label]
    return status.restarts == 1 and status.state == ServiceState.RUNNING


def test_a_crash_loop_leaves_the_service_stopped_and_names_its_log():
    home = short_tmp_dir("ringq-loop-")
    said: list[str] = []
    policy = RestartPolicy(max_restarts=2, first_backoff_s=0.05, window_s=60)
    try:
        settings = Settings(home=home, redis_url=None)
        with LocalCluster(settings, 1, name_prefix="loop") as cluster:
            cluster.wait_ready()
            supervisor = Supervisor(cluster, policy, say=said.append)
            for kill in range(3):
                os.kill(child_pid(cluster, "dispatcher"), signal.SIGKILL)
                wait_for(lambda: tick_until_changed(supervisor, said), "the exit to be seen")
                if kill < 2:
                    wait_for(lambda: tick_until_changed(supervisor, said), "a restart")
            status = {s.label: s for s in read_service_statuses(connect(cluster.url))}
            assert status["dispatcher"].state == ServiceState.STOPPED
            assert status["dispatcher"].restarts == 2
            assert status["loop-0"].state == ServiceState.RUNNING
            log_path = str(home / "logs" / "dispatcher.log")
            assert "crash loop" in said[-1] and log_path in said[-1]
            assert "dispatcher stopped" in services_line(list(status.values()))
            supervisor.close()
    finally:
        shutil.rmtree(home, ignore_errors=True)


def tick_until_changed(supervisor: Supervisor, said: list[str]) -> bool:
    before = len(said)
    supervisor.tick()
    return len(said) > before
