"""CLI start-up latency: `ringq status`, `ringq submit` and `ringq --version` as whole processes,
against two import floors (redis + click + pydantic; the same with a pydantic model's
`BaseModel`, which any pydantic model needs), and the same submit and status through the HTTP
API (`ringq serve`'s app), which pays start-up once.

    uv run python -m bench.cli_latency [--runs 7] [--out bench/results/cli-latency.json]

Starts a private Redis under a temporary RINGQ_HOME, submits one job (no dispatcher: it stays
queued) and fills the model metadata cache once, then runs each command `--runs` times after a
warm-up, the commands interleaved, and prints min / median / max wall seconds. Then serves the
app on uvicorn in a thread of this process and times `--runs` POST /api/jobs and GET
/api/jobs/{id} requests on one keep-alive connection (http.client), after one of each not
counted. Each command's ratio to the first floor is taken round by round (the floor ran beside
it), and its median reported, so a drift in the machine's speed cancels.
"""

import http.client
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

from cli.bench_machine import machine_info
from jobs.redis_server import ensure_redis
from jobs.settings import Settings

FLOORS = ("import redis, click, pydantic", "import redis, click; from pydantic import BaseModel")


def wall_s(argv: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run(argv, env=env, check=True, capture_output=True)
    return time.perf_counter() - started


def process_pass(commands: dict[str, list[str]], env: dict[str, str], runs: int) -> dict:
    """Wall seconds of each command, the commands interleaved; one warm-up round not counted."""
    times: dict[str, list[float]] = {name: [] for name in commands}
    for round_number in range(runs + 1):
        for name, argv in commands.items():
            seconds = wall_s(argv, env)
            if round_number:
                times[name].append(seconds)
    return times


def http_pass(home: Path, redis_url: str, document: str, runs: int) -> dict[str, list[float]]:
    """Seconds of each submit and status request on one keep-alive connection to the app."""
    from tests.cli.http_serving import serving

    settings = Settings(home=home, redis_url=redis_url)
    times: dict[str, list[float]] = {"HTTP POST /api/jobs": [], "HTTP GET /api/jobs/ID": []}
    body = json.dumps({"kind": "generate", "document": document, "max_tokens": 16})
    with serving(settings, redis_url) as base_url:
        connection = http.client.HTTPConnection(base_url.removeprefix("http://"), timeout=60)
        for round_number in range(runs + 1):
            seconds, job = timed_request(connection, "POST", "/api/jobs", body)
            if round_number:
                times["HTTP POST /api/jobs"].append(seconds)
            seconds, _ = timed_request(connection, "GET", f"/api/jobs/{job['id']}")
            if round_number:
                times["HTTP GET /api/jobs/ID"].append(seconds)
        connection.close()
    return times


def timed_request(
    connection: http.client.HTTPConnection, method: str, path: str, body: str | None = None
) -> tuple[float, dict]:
    headers = {"Content-Type": "application/json"} if body is not None else {}
    started = time.perf_counter()
    connection.request(method, path, body=body, headers=headers)
    response = connection.getresponse()
    payload = response.read()
    seconds = time.perf_counter() - started
    if response.status >= 300:
        raise click.ClickException(f"{method} {path}: {response.status} {payload[:200]!r}")
    return seconds, json.loads(payload)


def spread(values: list[float], scale: float = 1.0) -> dict[str, float]:
    low, mid, high = (scale * v for v in (min(values), statistics.median(values), max(values)))
    return {"min": round(low, 4), "median": round(mid, 4), "max": round(high, 4)}


def echo_times(times: dict[str, list[float]], unit: str = "s") -> dict[str, dict[str, float]]:
    scale = 1000.0 if unit == "ms" else 1.0
    figures = {name: spread(values, scale) for name, values in times.items()}
    for name, f in figures.items():
        low, mid, high = f["min"], f["median"], f["max"]
        click.echo(f"{name:<56} min {low:.3f}  median {mid:.3f}  max {high:.3f} {unit}")
    return figures


def floor_ratios(times: dict[str, list[float]]) -> dict[str, float]:
    """Each ringq command over the first floor, the median of the rounds' ratios."""
    floor = times[FLOORS[0]]
    return {
        name: round(statistics.median(a / b for a, b in zip(values, floor, strict=True)), 3)
        for name, values in times.items()
        if name.startswith("ringq")
    }


@click.command()
@click.option("--runs", type=click.IntRange(1), default=7, show_default=True)
@click.option("--out", type=click.Path(path_type=Path), default=None, help="Write the figures.")
def main(runs: int, out: Path | None) -> None:
    home = Path(tempfile.mkdtemp(prefix="ringq-lat-", dir="/tmp"))
    machine = machine_info(Settings(home=home, redis_url=None))
    handle = ensure_redis(Settings(home=home, redis_url=None))
    env = {**os.environ, "RINGQ_REDIS_URL": handle.url, "RINGQ_HOME": str(home)}
    ringq = [sys.executable, "-m", "cli.main"]
    doc = home / "doc.txt"
    doc.write_text("A short document for the latency benchmark.\n")
    try:
        submit = [*ringq, "submit", "generate", str(doc), "--max-tokens", "16"]
        job_id = subprocess.run(submit, env=env, check=True, capture_output=True, text=True)
        commands = {
            **{floor: [sys.executable, "-c", floor] for floor in FLOORS},
            "ringq --version": [*ringq, "--version"],
            "ringq status JOB": [*ringq, "status", job_id.stdout.strip()],
            "ringq submit generate DOC": submit,
        }
        times = process_pass(commands, env, runs)
        wall_s = echo_times(times)
        ratios = floor_ratios(times)
        click.echo(f"over `{FLOORS[0]}` (median of the rounds' ratios): {ratios}")
        http_ms = echo_times(http_pass(home, handle.url, doc.read_text(), runs), unit="ms")
    finally:
        handle.stop()
        shutil.rmtree(home, ignore_errors=True)
    if out:
        report = {
            "command": "python -m bench.cli_latency " + " ".join(sys.argv[1:]),
            "machine": machine,
            "load_avg_after": os.getloadavg(),
            "wall_s": wall_s,
            "over_floor": ratios,
            "http_ms": http_ms,
        }
        out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
