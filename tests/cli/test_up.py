"""`ringq up` in the foreground: services come up, and Ctrl-C (or SIGTERM) stops all of them,
the embedded Redis included."""

import os
import signal
import subprocess
import sys

import psutil
import pytest

from jobs.redis_server import SOCKET_NAME, is_alive, shutdown_embedded, unix_url
from jobs.settings import Settings
from tests.helpers import short_tmp_dir, wait_for


def ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM])
def test_up_starts_everything_and_stops_it_cleanly(stop_signal):
    """SIGINT reaches an `up` whose parent ignored it, as a script's `ringq up &` (or nohup)
    does: Python installs no SIGINT handler then, and `up` kept running (the chaos soak's
    `up_stopped_cleanly` failure)."""
    home = short_tmp_dir("ringq-up-")
    env = {k: v for k, v in os.environ.items() if k != "RINGQ_REDIS_URL"}
    env.update(RINGQ_HOME=str(home), RINGQ_RANK_PORT_BASE="32200")
    up = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "up", "--nodes", "2"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=ignore_sigint,
    )
    url = unix_url(home / "redis" / SOCKET_NAME)
    try:
        printed: list[str] = []
        wait_for(lambda: ready_line_seen(up, printed), "`ringq up` to say it is ready")
        nodes = [sys.executable, "-m", "cli.main", "nodes", "--json"]
        listed = subprocess.run(nodes, env=env, capture_output=True, text=True).stdout
        assert '"node-0"' in listed and '"node-1"' in listed
        children = psutil.Process(up.pid).children(recursive=True)
        assert len(children) >= 3  # dispatcher and two nodes (redis runs in its own session)
        up.send_signal(stop_signal)
        assert up.wait(timeout=30) == 0, up.stdout.read() if up.stdout else ""
        assert not [c for c in children if c.is_running() and c.status() != "zombie"]
        assert not is_alive(url)
    finally:
        if up.poll() is None:
            up.kill()
        shutdown_embedded(Settings(home=home, redis_url=None))  # only if a failure left it up


def ready_line_seen(up: subprocess.Popen, printed: list[str]) -> bool:
    """True once `up` has printed its ready line (after every node registered). A signal sent
    before that interrupts start-up instead: another path, which ends with exit code 130."""
    assert up.stdout is not None
    line = up.stdout.readline()
    assert line, f"`ringq up` exited before it was ready: {''.join(printed)}"
    printed.append(line)
    return "Ctrl-C stops" in " ".join("".join(printed).split())  # rich may wrap the line
