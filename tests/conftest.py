"""Session-wide test setup: a private RINGQ_HOME and one real redis-server for the whole run."""

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from jobs.redis_server import connect, ensure_redis
from jobs.settings import Settings, get_settings
from tests.helpers import short_tmp_dir

_SAVED_ENV: dict[str, str | None] = {}


def pytest_configure(config: pytest.Config) -> None:
    # Before collection, so nothing (not even import-time code) sees the user's data dir or Redis.
    for name in ("RINGQ_HOME", "RINGQ_REDIS_URL"):
        _SAVED_ENV[name] = os.environ.pop(name, None)
    os.environ["RINGQ_HOME"] = str(short_tmp_dir("ringq-home-"))
    get_settings.cache_clear()


def pytest_unconfigure(config: pytest.Config) -> None:
    home = os.environ.pop("RINGQ_HOME", None)
    if home:
        shutil.rmtree(home, ignore_errors=True)
    for name, value in _SAVED_ENV.items():
        if value is not None:
            os.environ[name] = value
    get_settings.cache_clear()


@pytest.fixture
def short_tmp_path() -> Iterator[Path]:
    """Like tmp_path, but short enough to hold a unix socket; removed afterwards."""
    path = short_tmp_dir("ringq-t-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of a real redis-server started through jobs.redis_server for this test session.

    It does not set RINGQ_REDIS_URL: a test that spawns ringq processes passes it on with
    monkeypatch.setenv("RINGQ_REDIS_URL", redis_url).
    """
    home = short_tmp_dir("ringq-redis-")
    handle = ensure_redis(Settings(home=home, redis_url=None))
    assert handle.owned, f"a Redis was already running for {home}"
    yield handle.url
    handle.stop()
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture
def redis_conn(redis_url: str) -> Iterator[redis.Redis]:
    """A bytes-returning client (as RQ needs) on an empty database."""
    client = connect(redis_url)
    client.flushall()
    yield client
    client.close()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A tiny random-weight Llama (float32) with SmolLM2's tokenizer, shared by the session."""
    from ring_worker.engine.models import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def broken_model_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    """The tiny model with its weights cut short: config and header read fine, loading fails."""
    broken = tmp_path_factory.mktemp("broken-model")
    for file in tiny_llama_dir.iterdir():
        if file.is_file():
            (broken / file.name).write_bytes(file.read_bytes())
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return broken


@pytest.fixture(scope="session")
def cluster():
    """`ringq up` in-process: its own Redis, a dispatcher and node-0, node-1 as real processes
    (not the `redis_url` server, which other tests flush)."""
    from tests.helpers import private_cluster

    # No automatic prefix reuse: tests that cancel mid-prefill need their prompts computed
    # (tests/jobs/test_prefix_service.py runs a cluster with it on).
    env = {"RINGQ_PREFILL_CHUNK_TOKENS": "128", "RINGQ_PREFIX_CACHE": "off"}
    with private_cluster("node", env) as running:
        yield running
