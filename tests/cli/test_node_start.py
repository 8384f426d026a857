"""`ringq node` stops at start, with one line, when it could only fail later on another machine:
a wrong Redis password (services ride out a lost connection, but not a refused password) and an
--address this machine does not have (its ranks could never listen there)."""

import os
import socket
import subprocess
import sys
import time

import pytest

from jobs.errors import RedisUnavailableError
from jobs.redis_server import SERVICE_RIDE_OUT_S, connect, ensure_redis, tcp_url
from jobs.settings import Settings


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_service_connection_refuses_a_wrong_password_at_once(short_tmp_path):
    port = free_port()
    settings = Settings(home=short_tmp_path, redis_url=None)
    with ensure_redis(settings, tcp_port=port, password="right"):
        started = time.monotonic()
        with pytest.raises(RedisUnavailableError, match="refuses the password") as caught:
            connect(tcp_url("127.0.0.1", port, "wrong"), ride_out_s=SERVICE_RIDE_OUT_S)
        assert time.monotonic() - started < 5
        assert "wrong" not in str(caught.value)
        connect(tcp_url("127.0.0.1", port, "right"), ride_out_s=SERVICE_RIDE_OUT_S).close()


def test_node_refuses_an_address_of_another_machine(short_tmp_path):
    env = {"RINGQ_HOME": str(short_tmp_path), "RINGQ_REDIS_URL": "redis://127.0.0.1:1/0"}
    out = subprocess.run(
        [sys.executable, "-m", "cli.main", "node", "--name", "n", "--address", "192.0.2.1"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert (
        len(lines) == 1 and "'--address': 192.0.2.1 is not an address of this machine" in lines[0]
    )
