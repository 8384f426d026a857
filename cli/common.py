"""What every command shares: the Redis connection, reading documents, one-object JSON output."""

import glob
import json
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from jobs.errors import InvalidJobError, RedisUnavailableError
from jobs.files import printable_name, read_at_most

if TYPE_CHECKING:
    import redis

    from jobs.settings import Settings


def redis_url_for(settings: "Settings") -> str:
    """RINGQ_REDIS_URL, else the embedded server of RINGQ_HOME if it runs."""
    from jobs.client import default_redis_url
    from jobs.redis_server import is_alive

    url = default_redis_url(settings)
    if not settings.redis_url and not is_alive(url):
        raise RedisUnavailableError(
            f"no Redis: start ringq with `ringq up` (embedded Redis under {settings.home}) "
            "or set RINGQ_REDIS_URL"
        )
    return url


def redis_connection() -> "redis.Redis":
    """A checked connection to ringq's Redis (one PING), or a one-line error."""
    from jobs.client import connect_client

    return connect_client()


def client():
    """A jobs.client.Client on ringq's Redis."""
    from jobs.client import Client

    return Client()


def expand_files(args: Sequence[str]) -> list[str]:
    """Paths of the documents that FILE arguments name: a file or '-' (stdin) as given, a
    directory as its regular, non-hidden files (sorted), a glob pattern as its matching files
    (sorted). A name that exists is never taken as a pattern."""
    paths: list[str] = []
    for arg in args:
        try:
            paths += _expand_one(arg)
        except OSError as exc:  # a name too long, a directory we may not list
            raise InvalidJobError(f"{arg}: {exc.strerror or exc}") from None
    if paths.count("-") > 1:
        raise InvalidJobError("'-' (stdin) can be given once")
    return paths


def _expand_one(arg: str) -> list[str]:
    path = Path(arg)
    if arg == "-" or path.is_file():
        return [arg]
    if path.is_dir():
        found = [
            str(p) for p in sorted(path.iterdir()) if p.is_file() and not p.name.startswith(".")
        ]
        if not found:
            raise InvalidJobError(f"{arg}: a directory with no files")
        return found
    if any(char in arg for char in "*?["):
        found = [p for p in sorted(glob.glob(arg, recursive=True)) if Path(p).is_file()]
        if not found:
            raise InvalidJobError(f"{arg}: no files match this pattern")
        return found
    raise InvalidJobError(f"{arg}: " + ("not a regular file" if path.exists() else "no such file"))


def read_document(path: str, max_bytes: int) -> tuple[str, str]:
    """(text, name) of a document given as a path or '-' for stdin; clear errors for bad input."""
    if path == "-":
        data = sys.stdin.buffer.read(max_bytes + 1)
        name = "<stdin>"
    else:
        file = Path(path)
        try:
            if not file.is_file():
                raise InvalidJobError(f"{path}: no such file")
            if file.stat().st_size > max_bytes:
                raise InvalidJobError(
                    f"{path}: {file.stat().st_size} bytes is over the limit of {max_bytes} "
                    "(RINGQ_MAX_DOCUMENT_BYTES)"
                )
            data = read_at_most(file, max_bytes)
        except OSError as exc:  # no permission, a name too long
            raise InvalidJobError(f"{path}: {exc.strerror or exc}") from None
        name = printable_name(file)
    if len(data) > max_bytes:
        raise InvalidJobError(f"{name}: over the limit of {max_bytes} bytes")
    try:
        text = data.decode("utf-8-sig")  # a byte-order mark is not part of the text
    except UnicodeDecodeError as exc:
        raise InvalidJobError(
            f"{name}: not UTF-8 text (byte {exc.start}); convert it to UTF-8 first"
        ) from None
    return text, name


def echo_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=None, sort_keys=False))


def interrupt_on_sigterm() -> None:
    """SIGTERM stops `up`, `demo`, `run` and `bench` as cleanly as Ctrl-C: their `finally` blocks
    stop the processes they started. SIGINT gets Python's handler back too: a command started
    in the background by a non-interactive shell inherits SIGINT ignored."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)
