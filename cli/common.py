"""What every command shares: the Redis connection, reading documents, one-object JSON output."""

import json
import sys
from pathlib import Path
from typing import Any

import click
import redis

from jobs.errors import InvalidJobError, RedisUnavailableError
from jobs.redis_server import SOCKET_NAME, connect, is_alive, redis_data_dir, unix_url
from jobs.settings import Settings, get_settings


def redis_url_for(settings: Settings) -> str:
    """RINGQ_REDIS_URL, else the embedded server of RINGQ_HOME if it runs."""
    if settings.redis_url:
        return settings.redis_url
    url = unix_url(redis_data_dir(settings) / SOCKET_NAME)
    if not is_alive(url):
        raise RedisUnavailableError(
            f"no Redis: start ringq with `ringq up` (embedded Redis under {settings.home}) "
            "or set RINGQ_REDIS_URL"
        )
    return url


def redis_connection() -> redis.Redis:
    return connect(redis_url_for(get_settings()))


def read_document(path: str, max_bytes: int) -> tuple[str, str]:
    """(text, name) of a document given as a path or '-' for stdin; clear errors for bad input."""
    if path == "-":
        data = sys.stdin.buffer.read(max_bytes + 1)
        name = "<stdin>"
    else:
        file = Path(path)
        if not file.is_file():
            raise InvalidJobError(f"{path}: no such file")
        if file.stat().st_size > max_bytes:
            raise InvalidJobError(
                f"{path}: {file.stat().st_size} bytes is over the limit of {max_bytes} "
                "(RINGQ_MAX_DOCUMENT_BYTES)"
            )
        data = file.read_bytes()
        name = file.name
    if len(data) > max_bytes:
        raise InvalidJobError(f"{name}: over the limit of {max_bytes} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidJobError(
            f"{name}: not UTF-8 text (byte {exc.start}); convert it to UTF-8 first"
        ) from None
    return text, name


def echo_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=None, sort_keys=False))
