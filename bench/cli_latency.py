"""CLI start-up latency: `ringq status`, `ringq submit` and `ringq --version` as whole processes,
against the import floor of redis + click + pydantic.

    uv run python -m bench.cli_latency [--runs 7]

Starts a private Redis under a temporary RINGQ_HOME, submits one job (no dispatcher: it stays
queued) and fills the model metadata cache once, then runs each command `--runs` times after a
warm-up, the commands interleaved, and prints min / median / max wall seconds. Figures:
bench/results/cli-latency.md.
"""

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

from jobs.redis_server import ensure_redis
from jobs.settings import Settings


def wall_s(argv: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run(argv, env=env, check=True, capture_output=True)
    return time.perf_counter() - started


@click.command()
@click.option("--runs", type=click.IntRange(1), default=7, show_default=True)
def main(runs: int) -> None:
    home = Path(tempfile.mkdtemp(prefix="ringq-lat-", dir="/tmp"))
    handle = ensure_redis(Settings(home=home, redis_url=None))
    env = {**os.environ, "RINGQ_REDIS_URL": handle.url, "RINGQ_HOME": str(home)}
    ringq = [sys.executable, "-m", "cli.main"]
    doc = home / "doc.txt"
    doc.write_text("A short document for the latency benchmark.\n")
    try:
        submit = [*ringq, "submit", "generate", str(doc), "--max-tokens", "16"]
        job_id = subprocess.run(submit, env=env, check=True, capture_output=True, text=True)
        floor = "import redis, click, pydantic"
        commands = {
            floor: [sys.executable, "-c", floor],
            "ringq --version": [*ringq, "--version"],
            "ringq status JOB": [*ringq, "status", job_id.stdout.strip()],
            "ringq submit generate DOC": submit,
        }
        times: dict[str, list[float]] = {name: [] for name in commands}
        for round_number in range(runs + 1):  # round 0 is the warm-up
            for name, argv in commands.items():
                seconds = wall_s(argv, env)
                if round_number:
                    times[name].append(seconds)
        for name, values in times.items():
            click.echo(
                f"{name:<32} min {min(values):.3f}  median {statistics.median(values):.3f}  "
                f"max {max(values):.3f} s"
            )
    finally:
        handle.stop()
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
