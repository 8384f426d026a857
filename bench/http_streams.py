"""Does an open chat stream slow the other requests of `ringq serve`? Side by side in one run:
N streamed chat completions held open (their jobs queued, no dispatcher: each stream waits on
its job's text with a blocking XREAD), and meanwhile GET /v1/models timed M times; once with the
streams' reads in their own thread pool (chat_stream.STREAM_READERS, as served) and once in the
pool every route shares (anyio's default, 40 threads), then with no stream open as the floor.

    uv run python -m bench.http_streams --streams 60 --requests 40

Writes bench/results/http-streams.json.
"""

import json
import statistics
import threading
import time
import urllib.request
from pathlib import Path

import click

from cli.http import chat_stream
from jobs.redis_server import ensure_redis, shutdown_embedded
from jobs.settings import Settings
from tests.cli.http_serving import serving
from tests.helpers import short_tmp_dir

RESULTS = Path(__file__).parent / "results"
MODEL = "random:tiny-llama"


def open_stream(base_url: str, opened: threading.Event, stop: threading.Event) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me about rings."}],
        "max_tokens": 8,
        "stream": True,
    }
    request = urllib.request.Request(
        f"{base_url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        response.readline()  # the role chunk: the job is queued and its stream is reading
        opened.set()
        stop.wait()


def time_requests(base_url: str, count: int) -> list[float]:
    times_ms = []
    for _ in range(count):
        started = time.perf_counter()
        with urllib.request.urlopen(f"{base_url}/v1/models", timeout=60) as response:
            response.read()
        times_ms.append((time.perf_counter() - started) * 1000)
        time.sleep(0.05)
    return times_ms


def measure(base_url: str, streams: int, requests: int) -> dict:
    stop = threading.Event()
    opened = [threading.Event() for _ in range(streams)]
    threads = [
        threading.Thread(target=open_stream, args=(base_url, event, stop), daemon=True)
        for event in opened
    ]
    for thread in threads:
        thread.start()
    for event in opened:
        if not event.wait(120):
            raise click.ClickException("a stream did not open within 120 s")
    times_ms = time_requests(base_url, requests)
    stop.set()
    return {
        "streams_open": streams,
        "models_ms": {
            "p50": statistics.median(times_ms),
            "p90": sorted(times_ms)[int(0.9 * len(times_ms))],
            "max": max(times_ms),
        },
    }


@click.command()
@click.option("--streams", default=60, show_default=True)
@click.option("--requests", default=40, show_default=True)
def main(streams: int, requests: int) -> None:
    home = short_tmp_dir("ringq-streams-")
    settings = Settings(home=home, redis_url=None)
    handle = ensure_redis(settings)
    own_pool = chat_stream.STREAM_READERS
    result: dict = {"when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    try:
        with serving(settings, handle.url) as base_url:
            result["no_stream"] = measure(base_url, 0, requests)
            chat_stream.STREAM_READERS = None  # type: ignore[assignment]  # anyio's shared pool
            result["shared_pool"] = measure(base_url, streams, requests)
            chat_stream.STREAM_READERS = own_pool
            result["own_pool"] = measure(base_url, streams, requests)
    finally:
        shutdown_embedded(settings)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "http-streams.json").write_text(json.dumps(result, indent=1))
    click.echo(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
