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


class FailingService:
    """A Supervised (cli/supervisor.py) of one service, "svc", whose every process is a real one
    that has already exited (code 1) when the supervisor looks: it crashes at each tick the
    supervisor does not restart it."""

    def __init__(self, redis_url: str, home):
        self.url = redis_url
        self.redis = None
        self.settings = Settings(home=home, redis_url=redis_url)
        self.children = [("svc", self._spawn(), home / "svc.log")]

    def _spawn(self) -> subprocess.Popen:
        process = subprocess.Popen([shutil.which("false") or "false"])
        process.wait()
        return process

    def restart(self, label: str) -> subprocess.Popen:
        process = self._spawn()
        self.children = [(label, process, path) for label, _, path in self.children]
        return process


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def crash_and_restart(supervisor: Supervisor, clock: FakeClock, said: list[str], at_s: float):
    """The service exits at `at_s` (seen by a tick then); its backoff, and the restart after it.
    None: left stopped."""
    clock.now_s = at_s
    supervisor.tick()
    track = supervisor.tracks["svc"]
    if track.stopped:
        return None
    assert track.due_at_s is not None, said[-1]
    backoff_s = track.due_at_s - at_s
    assert f"restarting in {backoff_s:.1f} s" in said[-1]
    clock.now_s = track.due_at_s - 0.01
    supervisor.tick()
    assert track.due_at_s is not None  # not before its backoff
    clock.now_s = track.due_at_s
    supervisor.tick()
    assert track.due_at_s is None and "restarted" in said[-1]
    return backoff_s


def test_backoff_resets_after_a_quiet_window(redis_url, redis_conn, short_tmp_path):
    """Restarts within `window_s` double the backoff; once a whole window passes without one,
    the next crash starts again from `first_backoff_s`, and a service that crashes once per
    window is never taken for a crash loop (a fake clock: no sleeps)."""
    policy = RestartPolicy(max_restarts=3, window_s=60.0, first_backoff_s=0.5, max_backoff_s=8.0)
    clock, said = FakeClock(), []
    supervisor = Supervisor(FailingService(redis_url, short_tmp_path), policy, said.append, clock)
    try:
        start = clock.now_s
        backoffs = [crash_and_restart(supervisor, clock, said, start + t) for t in (0, 1, 3)]
        assert backoffs == [0.5, 1.0, 2.0]  # restarts at +0.5, +2.0, +5.0
        # at +61 s the first restart has left the window, the other two count
        assert crash_and_restart(supervisor, clock, said, start + 61) == 2.0
        # a whole window after the last restart (+63): from the first backoff again
        last = supervisor.tracks["svc"].restart_times_s[-1]
        assert crash_and_restart(supervisor, clock, said, last + policy.window_s) == 0.5
        for _ in range(2 * policy.max_restarts):  # one crash per window, for ever
            later = supervisor.tracks["svc"].restart_times_s[-1] + policy.window_s + 1
            assert crash_and_restart(supervisor, clock, said, later) == 0.5
        status = {s.label: s for s in read_service_statuses(redis_conn)}["svc"]
        assert status.state == ServiceState.RUNNING
        assert status.restarts == 5 + 2 * policy.max_restarts
        # and crashes close together again still end in a crash loop
        now = clock.now_s
        assert [crash_and_restart(supervisor, clock, said, now + t) for t in (1, 3)] == [1.0, 2.0]
        assert crash_and_restart(supervisor, clock, said, clock.now_s + 1) is None
        assert "crash loop" in said[-1]
    finally:
        supervisor.close()
